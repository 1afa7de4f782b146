"""Driving an engine's `step()` directly, as the offline tests do (no tests here)."""

from __future__ import annotations

from typing import Any

from engine.output.request_output import OutputAccumulator, RequestOutput


def run_to_finals(engine: Any, max_steps: int | None = None) -> dict[str, RequestOutput]:
    """Steps `engine` until it holds no request (or `max_steps` ran); the whole output of
    every request that finished meanwhile, built from its deltas."""
    sums: dict[str, OutputAccumulator] = {}
    finals: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
        steps += 1
        for delta in engine.step():
            acc = sums.setdefault(delta.request_id, OutputAccumulator(delta.request_id))
            acc.add(delta)
            if delta.finished:
                finals[delta.request_id] = acc.output()
                del sums[delta.request_id]
    return finals
