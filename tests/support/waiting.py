"""Waiting on states and events, never on the clock (no tests here).

A test's verdict must not depend on how fast the box is. The tiny model finishes a request
in milliseconds on a fast idle machine and in seconds on a slow loaded one, so "it will
still be running after N ms" and "it will have finished within N ms" are both races.
Two tools replace them:

- `wait_for` / `wait_for_async` poll a condition until it holds. Their timeout is a hang
  guard only (`HANG_S`, far above anything a healthy run needs on the slowest box): it turns
  a hang into a failure with a message, it never decides a verdict.
- `StepGate` makes an engine's steps wait for the test: a request cannot finish, and a
  queue cannot drain, until the test lets the steps run. While held, a step computes
  nothing and returns at once with no outputs, so the AsyncEngine loop keeps handling its
  inbox: adds are acknowledged, aborts and shutdowns land, exactly as between real steps.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

# The hang guard: how long a condition that should hold within moments may take before the
# test gives up. Generous on purpose; a healthy run never comes near it.
HANG_S = 120.0

# How often a held step looks at the gate again before handing control back to the engine
# loop (which then handles its inbox and calls the step again). Latency only, not a verdict.
_HELD_POLL_S = 0.005


def wait_for(cond: Callable[[], bool], what: str = "condition", timeout: float = HANG_S) -> None:
    """Returns once `cond()` is true; fails with `what` if it is still false after `timeout`."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout:.0f}s (hang guard)")
        time.sleep(0.005)


async def wait_for_async(
    cond: Callable[[], bool], what: str = "condition", timeout: float = HANG_S
) -> None:
    """`wait_for` for coroutines: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout:.0f}s (hang guard)")
        await asyncio.sleep(0.005)


class StepGate:
    """Holds an engine's steps until the test lets them run.

    Installs itself over `llm_engine.step` (an LLMEngine or the fake). A step runs when a
    permit is available (`allow(n)` adds n; `open()` lifts the count) and `hold_while()`,
    if given, is false; otherwise it is held. `steps` counts the steps that really ran
    (the AsyncEngine's own `num_steps` also counts held ones). `remove()` (or leaving the
    `with` block) restores the engine's own step.
    """

    def __init__(
        self,
        llm_engine: Any,
        permits: int | None = 0,
        hold_while: Callable[[], bool] | None = None,
    ):
        self._engine = llm_engine
        self._step = llm_engine.step
        self._cond = threading.Condition()
        self._permits = permits  # None: open
        self._hold_while = hold_while
        self.steps = 0
        llm_engine.step = self._gated_step

    # ---- the test's side ---------------------------------------------------------------------
    def allow(self, n: int = 1) -> None:
        """Lets `n` more steps run (thread-safe; no effect while open)."""
        with self._cond:
            if self._permits is not None:
                self._permits += n
            self._cond.notify_all()

    def open(self) -> None:
        """Every step runs from now on (until `close`)."""
        with self._cond:
            self._permits = None
            self._cond.notify_all()

    def close(self) -> None:
        """No step runs until `allow` or `open` (a running step completes)."""
        with self._cond:
            self._permits = 0

    def wait_steps(self, n: int, timeout: float = HANG_S) -> None:
        """Blocks until at least `n` steps have run in all."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.steps >= n, timeout):
                raise AssertionError(f"{n} engine steps not run within {timeout:.0f}s (hang guard)")

    def remove(self) -> None:
        self.open()
        self._engine.step = self._step

    def __enter__(self) -> StepGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ---- the engine thread's side -----------------------------------------------------------
    def _may_step(self) -> bool:
        if self._permits is not None and self._permits <= 0:
            return False
        return self._hold_while is None or not self._hold_while()

    def _gated_step(self) -> list:
        with self._cond:
            if not self._may_step():
                self._cond.wait(_HELD_POLL_S)
                if not self._may_step():
                    return []  # held: nothing computed; the engine loop reads its inbox
            if self._permits is not None:
                self._permits -= 1
        out = self._step()
        with self._cond:
            self.steps += 1
            self._cond.notify_all()
        return out
