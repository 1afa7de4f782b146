"""A daemon thread that builds a value and then runs a loop with it: the engine is built on
the very thread that will step it.

Why: torch's CPU kernels (and ours, engine/worker/kernels) run on OpenMP, and libgomp keeps
one worker pool per OS thread that has run a parallel region. A model loaded on the main
thread leaves the main thread's pool behind, its workers idle; from then on libgomp counts
more of its threads than CPUs, stops letting idle workers spin, and every parallel region
of the stepping thread waits for its workers to be woken by the kernel. Measured on
2 cores (AMD EPYC, the default model's batch-1 decode step, 2026-12-04): 11.5 ms on the
thread that loaded the model, 22.9 ms on another one; one quantized linear 131 µs vs
286 µs. Built and stepped on one thread, only that thread's pool exists.

`build` runs first; the constructor returns (or raises what `build` raised) once it has.
`run(fn)` then lets the same thread go on with `fn`; the thread exits if it is never told.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BuiltOnThread(Generic[T]):
    """`build()` on a new daemon thread named `name`; its result is `value`."""

    def __init__(self, name: str, build: Callable[[], T]):
        self._build = build
        self._fn: Callable[[], None] | None = None
        self._built = threading.Event()
        self._go = threading.Event()
        self._error: BaseException | None = None
        self._value: T | None = None
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._built.wait()
        if self._error is not None:
            self.thread.join()
            raise self._error
        self.value: T = self._value  # type: ignore[assignment]

    def _main(self) -> None:
        try:
            self._value = self._build()
        except BaseException as e:  # handed to the constructor's caller
            self._error = e
            self._built.set()
            return
        self._built.set()
        self._go.wait()
        if self._fn is not None:
            self._fn()

    def run(self, fn: Callable[[], None] | None) -> None:
        """Lets the thread go on with `fn` (None: it exits)."""
        self._fn = fn
        self._go.set()
