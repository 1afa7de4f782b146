"""`LoRABatch`: which rows of a step go through which adapter slot, built once per step.

The runner flattens a step into rows (tokens) grouped by request; each request runs one
adapter slot or none (-1). The LoRA product wants rows grouped by slot, so every wrapped
linear can multiply a slot's rows by that slot's weights in one batched product::

    token slots   [ 2  2  2 -1  0  1  0 ]        (rows 0..6 of the step)
    by slot       slot 0: rows 4 6 | slot 1: row 5 | slot 2: rows 0 1 2
    padded        [[4 6 4] [5 4 4] [0 1 2]]      3 slots x 3 rows; padding repeats a row
    gather_back   [ 6 7 8 9 0 3 1 ]              row i's delta sits at position gather_back[i]
                                                 of the flattened block; 9 = a zero row

`torch.bmm` over the padded block computes each slot's rows with its own weights, into a
buffer with one extra zero row; each row then reads its delta back by `gather_back` and
adds it (a gather: on the CPU, a scatter-add by row index costs ~5 µs per row). Padding
costs (slots x longest) - rows extra rows; when that exceeds the rows themselves (one long
prefill beside a few decodes, say), the wrappers take one product per active slot instead,
over the rows in slot order (`padded_rows` None). Both are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Padded rows beyond this multiple of the real rows: one product per active slot instead.
MAX_PADDING_RATIO = 2.0


@dataclass
class LoRABatch:
    slots: list[int]  # the active slots, ascending
    # Rows of the delta buffer before its zero row: padded block, or rows in slot order.
    num_positions: int
    gather_back: torch.Tensor  # [T]: each step row's position in the buffer (zero row: base)
    # Batched: rows gathered slot by slot for slots [lo, hi), rows_per_slot each.
    padded_rows: torch.Tensor | None
    slot_range: tuple[int, int]
    rows_per_slot: int
    # One product per slot (padded_rows None): (slot, its rows, first buffer position).
    segments: list[tuple[int, torch.Tensor, int]]


def build_lora_batch(
    request_slots: np.ndarray,  # [num_reqs] int64, -1: the base model
    query_lens: np.ndarray,  # [num_reqs] int64, rows per request in step order
    device: torch.device,
) -> LoRABatch | None:
    """The step's `LoRABatch`, or None when no row runs an adapter."""
    token_slots = np.repeat(request_slots, query_lens)
    rows = np.flatnonzero(token_slots >= 0)
    if rows.size == 0:
        return None
    order = np.argsort(token_slots[rows], kind="stable")
    rows, row_slots = rows[order], token_slots[rows][order]
    slots, counts = np.unique(row_slots, return_counts=True)
    lo, hi, longest = int(slots[0]), int(slots[-1]) + 1, int(counts.max())
    active = slots.tolist()
    starts = np.cumsum(counts) - counts
    if (hi - lo) * longest > MAX_PADDING_RATIO * rows.size:
        positions = np.arange(rows.size)  # rows in slot order, no padding
        segments = [
            (slot, _to(rows[s : s + n], device), int(s))
            for slot, s, n in zip(active, starts.tolist(), counts.tolist(), strict=True)
        ]
        padded, size = None, rows.size
    else:
        within = np.arange(rows.size) - np.repeat(starts, counts)
        positions = (row_slots - lo) * longest + within  # each row's place in the block
        size = (hi - lo) * longest
        block = np.full(size, rows[0], dtype=np.int64)
        block[positions] = rows
        padded, segments = _to(block, device), []
    gather_back = np.full(token_slots.size, size, dtype=np.int64)  # base rows: the zero row
    gather_back[rows] = positions
    return LoRABatch(active, size, _to(gather_back, device), padded, (lo, hi), longest, segments)


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
