"""`LoRABatch`: which rows of a step go through which adapter slot, built once per step.

The runner's input preparation orders the step's requests by adapter slot, stably, with
the base model's requests last (`ModelLoRA.order_step`), so each slot's rows are one
contiguous range of the flattened batch::

    rows     0 1 2 3 | 4 5 | 6 7 8 9 | 10 11
    slot       0     |  1  |    3    |  base
    segments (0, 0, 4), (1, 4, 6), (3, 6, 10)

Every wrapped linear then adds each segment's delta to its own rows, reading x and writing
y in place (no gather, no scatter). When the segments are all equally long over
consecutive slots (a decode step whose requests spread evenly over the adapters), the
whole block is one `torch.bmm` over slots: `x[:n].view(slots, rows, in)` by the slots'
stacked weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LoRABatch:
    slots: tuple[int, ...]  # the active slots, ascending
    segments: tuple[tuple[int, int, int], ...]  # (slot, first row, end row), in row order
    # Set when one bmm covers every segment: (first slot, end slot, rows per slot).
    uniform: tuple[int, int, int] | None


def build_lora_batch(
    request_slots: np.ndarray,  # [num_reqs] int64 ascending, then -1 (base model) last
    query_lens: np.ndarray,  # [num_reqs] int64, rows per request in step order
) -> LoRABatch | None:
    """The step's `LoRABatch`, or None when no row runs an adapter."""
    has = request_slots >= 0
    if not has.any():
        return None
    slots = request_slots[has]
    if np.any(np.diff(slots) < 0) or not has[: slots.size].all():
        raise ValueError("requests must be ordered by adapter slot, base model last")
    rows = query_lens[has]
    ends = np.cumsum(rows)
    active, first = np.unique(slots, return_index=True)
    last = np.append(first[1:], slots.size) - 1
    bounds = np.concatenate(([0], ends))
    starts, stops = bounds[first], bounds[last + 1]
    segments = tuple(
        (int(s), int(a), int(b))
        for s, a, b in zip(active.tolist(), starts.tolist(), stops.tolist(), strict=True)
    )
    lengths = stops - starts
    consecutive = active[-1] - active[0] + 1 == active.size
    uniform = None
    if consecutive and (lengths == lengths[0]).all():
        uniform = (int(active[0]), int(active[-1]) + 1, int(lengths[0]))
    return LoRABatch(tuple(active.tolist()), segments, uniform)
