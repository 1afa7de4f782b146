"""`appliance` with a fault built into the engine, for subprocess tests (no tests here).

    python -m tests.support.fault_launcher FAULT ARG -- serve --set ...

FAULT is applied before the CLI starts, so the server process is exactly `appliance serve`
apart from its engine step:

- `fail_after N`: model steps after the first N raise (a device that has died for good).
- `hang_after N`: model steps after the first N block forever (a wedged device or kernel).
- `gate PATH`: the test decides how many engine steps may run by writing that number into
  the file PATH (a missing or unreadable file allows none). A step that may not run yet
  computes nothing and returns at once, so the server stays responsive (new requests,
  aborts, SIGTERM) while its requests cannot progress: the subprocess form of
  `tests.support.waiting.StepGate`.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

FAULTS = ("fail_after", "hang_after", "gate")


def install_model_fault(fault: str, after: int) -> None:
    from engine.worker.runner import ModelRunner

    execute = ModelRunner.execute
    calls = {"n": 0}

    def faulty(self: Any, so: Any) -> Any:
        if so.is_empty:  # bookkeeping-only steps stay healthy
            return execute(self, so)
        calls["n"] += 1
        if calls["n"] > after:
            if fault == "fail_after":
                raise RuntimeError("injected persistent device failure")
            threading.Event().wait()  # hang_after: forever
        return execute(self, so)

    ModelRunner.execute = faulty


def install_gate(path: Path) -> None:
    from engine.llm_engine import LLMEngine

    step = LLMEngine.step
    ran = {"n": 0}

    def allowed() -> int:
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            return 0

    def gated(self: Any) -> Any:
        if ran["n"] >= allowed():
            time.sleep(0.005)  # held: the engine loop reads its inbox and comes back
            return []
        ran["n"] += 1
        return step(self)

    LLMEngine.step = gated


def main(argv: list[str]) -> int:
    fault, arg, sep, *cli = argv
    if sep != "--" or fault not in FAULTS:
        raise SystemExit(__doc__)
    if fault == "gate":
        install_gate(Path(arg))
    else:
        install_model_fault(fault, int(arg))
    from appliance.cli import main as cli_main

    return cli_main(cli)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
