"""A scheduler clock a test can move forward, so that a deadline passes exactly when the
test says (no test waits for real time to pass). No tests here.

Deadlines are stamped by the frontends on `time.monotonic()`; the engine's scheduler reads
them against its own clock. `SkewedClock.install(llm_engine)` replaces that clock by
monotonic time plus a skew the test sets (`jump(seconds)`), and `remove()` puts it back.
"""

from __future__ import annotations

import time
from typing import Any


class SkewedClock:
    def __init__(self) -> None:
        self.skew = 0.0
        self._scheduler: Any = None
        self._clock: Any = None

    def __call__(self) -> float:
        return time.monotonic() + self.skew

    def jump(self, seconds: float) -> None:
        """Every deadline less than `seconds` away has passed from now on."""
        self.skew += seconds

    def install(self, llm_engine: Any) -> SkewedClock:
        self._scheduler = llm_engine.scheduler
        self._clock = self._scheduler.clock
        self._scheduler.clock = self
        return self

    def remove(self) -> None:
        if self._scheduler is not None:
            self._scheduler.clock = self._clock
            self._scheduler = None

    def __enter__(self) -> SkewedClock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
