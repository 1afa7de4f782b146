"""A stand-in for a captured CUDA graph, so capture/replay control flow runs on the CPU."""

from __future__ import annotations

from collections.abc import Callable


class ReplayGraph:
    """A 'graph' that re-runs its body on replay (what a CUDA graph does, minus the speed)."""

    def __init__(self, body: Callable[[], None]):
        self.body = body
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.body()
