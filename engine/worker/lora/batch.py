"""`LoRABatch`: which rows of a step go through which adapter slot, built once per step.

The runner flattens a step into rows (tokens) grouped by request; each request runs one
adapter slot or none (-1). The LoRA product wants rows grouped by slot, so every wrapped
linear can multiply a slot's rows by that slot's weights in one batched product::

    token slots   [ 2  2  2 -1  0  1  0 ]        (rows 0..6 of the step)
    by slot       slot 0: rows 4 6 | slot 1: row 5 | slot 2: rows 0 1 2
    padded        [[4 6 4] [5 4 4] [0 1 2]]      3 slots x 3 rows; padding repeats a row
    keep          positions 0 1 3 6 7 8 of the flattened padded block: the real rows

`torch.bmm` over the padded block computes each slot's rows with its own weights; the kept
results are added into their rows. Padding costs (slots x longest) - rows extra rows; when
that exceeds the rows themselves (one long prefill beside a few decodes, say) the wrappers
take one product per active slot instead (`padded_rows` None). Both are exact.
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
    # One product per slot: each active slot's rows (set when padded_rows is None).
    slot_rows: list[torch.Tensor]
    # Batched: rows gathered slot by slot for slots [lo, hi), rows_per_slot each.
    padded_rows: torch.Tensor | None
    slot_range: tuple[int, int]
    rows_per_slot: int
    keep: torch.Tensor | None  # positions of real rows in the padded block; None: all are
    dst_rows: torch.Tensor | None  # the step rows those positions add into


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
    if (hi - lo) * longest > MAX_PADDING_RATIO * rows.size:
        per_slot = np.split(rows, np.cumsum(counts)[:-1])
        return LoRABatch(
            active, [_to(r, device) for r in per_slot], None, (lo, hi), longest, None, None
        )
    starts = np.cumsum(counts) - counts
    within = np.arange(rows.size) - np.repeat(starts, counts)
    flat = (row_slots - lo) * longest + within  # each real row's place in the padded block
    padded = np.full((hi - lo) * longest, rows[0], dtype=np.int64)
    padded[flat] = rows
    keep = None if flat.size == padded.size else _to(flat, device)
    return LoRABatch(active, [], _to(padded, device), (lo, hi), longest, keep, _to(rows, device))


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
