"""`appliance` with a fault built into the model step, for subprocess tests (no tests here).

    python -m tests.fault_launcher FAULT ARG -- serve --set ...

FAULT is applied to `ModelRunner.execute` before the CLI starts, so the server process is
exactly `appliance serve` apart from its model step:

- `slow SECONDS`: every step sleeps first (requests outlive a shutdown grace period).
- `fail_after N`: steps after the first N raise (a device that has died for good).
- `hang_after N`: steps after the first N block forever (a wedged device or kernel).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any


def install(fault: str, arg: float) -> None:
    from engine.runner import ModelRunner

    execute = ModelRunner.execute
    calls = {"n": 0}

    def faulty(self: Any, so: Any) -> Any:
        if so.is_empty:  # bookkeeping-only steps stay healthy
            return execute(self, so)
        calls["n"] += 1
        if fault == "slow":
            time.sleep(arg)
        elif fault == "fail_after" and calls["n"] > arg:
            raise RuntimeError("injected persistent device failure")
        elif fault == "hang_after" and calls["n"] > arg:
            threading.Event().wait()  # forever
        return execute(self, so)

    ModelRunner.execute = faulty


def main(argv: list[str]) -> int:
    fault, arg, sep, *cli = argv
    if sep != "--" or fault not in ("slow", "fail_after", "hang_after"):
        raise SystemExit(__doc__)
    install(fault, float(arg))
    from appliance.cli import main as cli_main

    return cli_main(cli)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
