"""Batch-size buckets for decode graphs: which sizes to capture, which one a step uses, padding.

A CUDA graph replays fixed shapes at fixed addresses, so decode steps run in buckets: a step
of n requests uses the smallest captured size b >= n, copied into static buffers whose
first b rows the graph for b reads. Rows n..b-1 are padding and must be harmless:

    row:            0 .. n-1 (real requests)      n .. b-1 (padding)
    token id        the step's                    PAD_TOKEN_ID
    position        the step's                    PAD_POSITION
    slot            the step's                    -1: the K/V write goes nowhere
    seq_len         the step's                    1: attends to one (stale) slot
    block table     the step's                    PAD_BLOCK: read, never written

Padded rows compute garbage that nobody reads: every op of the model is row-independent
except attention, which is per request. The caller slices the first n output rows.

Plain tensors and sizes only: what a step means to attention (its metadata) is the engine's
business (`engine/worker/decode_graphs.py`), so this package imports nothing from it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD_TOKEN_ID = 0
PAD_POSITION = 0
PAD_SLOT = -1
PAD_SEQ_LEN = 1
PAD_BLOCK = 0


def default_capture_sizes(max_num_seqs: int = 256) -> tuple[int, ...]:
    """`[1, 2, 4] + range(8, 257, 8)` trimmed to `max_num_seqs` (at least `(1,)`)."""
    sizes = [1, 2, 4, *range(8, 257, 8)]
    return tuple(s for s in sizes if s <= max_num_seqs) or (1,)


def capture_sizes(configured: Sequence[int] | None, max_num_seqs: int) -> tuple[int, ...]:
    """Sorted, unique bucket sizes no larger than `max_num_seqs`.

    `configured` is the user's list (None: `default_capture_sizes`). A configured list with
    nothing <= max_num_seqs becomes `(max_num_seqs,)`: no step is larger, so that one bucket
    serves every batch.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if configured is None:
        return default_capture_sizes(max_num_seqs)
    sizes = sorted({int(s) for s in configured if 1 <= int(s) <= max_num_seqs})
    return tuple(sizes) or (max_num_seqs,)


def pick_bucket(sizes: Sequence[int], batch: int) -> int | None:
    """The smallest size >= batch in the sorted `sizes`; None when the batch is larger."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def pad_into(dst: torch.Tensor, src: torch.Tensor, fill: int | float) -> None:
    """dst[:len(src)] = src, dst[len(src):] = fill (in place; dst keeps its address)."""
    n = src.shape[0]
    if n > dst.shape[0]:
        raise ValueError(f"{n} rows do not fit a buffer of {dst.shape[0]}")
    dst[:n].copy_(src)
    dst[n:].fill_(fill)


@dataclass
class StaticDecodeInputs:
    """Fixed-address inputs for the largest bucket; the bucket of size b uses the first b rows.

    A captured graph reads exactly these tensors, so every step is copied into them in place.
    """

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64
    seq_lens: torch.Tensor  # [max_batch] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] int32, always 0..max_batch (decode)
    block_tables: torch.Tensor  # [max_batch, max_blocks_per_seq] int32

    @classmethod
    def allocate(
        cls, max_batch: int, max_blocks_per_seq: int, device: torch.device | str
    ) -> StaticDecodeInputs:
        def full(shape: tuple[int, ...], value: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        return cls(
            input_ids=full((max_batch,), PAD_TOKEN_ID, torch.int64),
            positions=full((max_batch,), PAD_POSITION, torch.int64),
            slot_mapping=full((max_batch,), PAD_SLOT, torch.int64),
            seq_lens=full((max_batch,), PAD_SEQ_LEN, torch.int32),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            block_tables=full((max_batch, max(1, max_blocks_per_seq)), PAD_BLOCK, torch.int32),
        )

    @property
    def max_batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def fill(
        self,
        bucket: int,
        *,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        slot_mapping: torch.Tensor,  # [n] int64
        seq_lens: torch.Tensor,  # [n] int32
        block_tables: torch.Tensor,  # [n, width] int32
    ) -> None:
        """Copy n decode rows into the first `bucket` rows; rows n..bucket-1 become padding."""
        n = input_ids.shape[0]
        if not 1 <= n <= bucket <= self.max_batch:
            raise ValueError(f"{n} requests do not fit bucket {bucket} (max {self.max_batch})")
        width = block_tables.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block table of {width} columns > {self.max_blocks_per_seq}")
        pad_into(self.input_ids[:bucket], input_ids, PAD_TOKEN_ID)
        pad_into(self.positions[:bucket], positions, PAD_POSITION)
        pad_into(self.slot_mapping[:bucket], slot_mapping, PAD_SLOT)
        pad_into(self.seq_lens[:bucket], seq_lens, PAD_SEQ_LEN)
        pad_into(self.block_tables[:bucket, :width], block_tables, PAD_BLOCK)

    def fill_padding(self, bucket: int) -> None:
        """The first `bucket` rows all padding: the dummy batch graphs are captured with."""
        if not 1 <= bucket <= self.max_batch:
            raise ValueError(f"bucket {bucket} outside 1..{self.max_batch}")
        for t, fill in (
            (self.input_ids, PAD_TOKEN_ID),
            (self.positions, PAD_POSITION),
            (self.slot_mapping, PAD_SLOT),
            (self.seq_lens, PAD_SEQ_LEN),
            (self.block_tables, PAD_BLOCK),
        ):
            t[:bucket].fill_(fill)
