"""Bucket sizes, bucket choice and the padding of a decode step into static buffers."""

from __future__ import annotations

import pytest
import torch

from graphs.buckets import (
    PAD_BLOCK,
    PAD_POSITION,
    PAD_SEQ_LEN,
    PAD_SLOT,
    PAD_TOKEN_ID,
    StaticDecodeInputs,
    capture_sizes,
    default_capture_sizes,
    pad_into,
    pick_bucket,
)


def test_default_capture_sizes_are_powers_then_multiples_of_eight():
    sizes = capture_sizes(None, 256)
    assert sizes[:5] == (1, 2, 4, 8, 16)
    assert sizes[-1] == 256
    assert len(sizes) == 3 + 32
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:], strict=False))


def test_capture_sizes_are_trimmed_to_max_num_seqs():
    assert capture_sizes(None, 20) == (1, 2, 4, 8, 16)
    assert capture_sizes(None, 1) == (1,)


def test_no_configured_sizes_means_the_default():
    assert capture_sizes(None, 64) == default_capture_sizes(64)
    assert default_capture_sizes(0) == (1,)


def test_configured_capture_sizes_win_sorted_and_unique():
    assert capture_sizes((16, 4, 4, 1, 512), 64) == (1, 4, 16)
    assert capture_sizes((128, 256), 64) == (64,)


@pytest.mark.parametrize(
    "batch,bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16), (17, None)]
)
def test_pick_bucket_is_the_smallest_size_that_fits(batch, bucket):
    assert pick_bucket((1, 2, 4, 8, 16), batch) == bucket


def test_pick_bucket_rejects_empty_batches():
    with pytest.raises(ValueError):
        pick_bucket((1, 2), 0)


def test_pad_into_fills_the_tail_in_place():
    dst = torch.full((5,), 7)
    ptr = dst.data_ptr()
    pad_into(dst, torch.tensor([1, 2]), -1)
    assert dst.tolist() == [1, 2, -1, -1, -1]
    assert dst.data_ptr() == ptr
    with pytest.raises(ValueError):
        pad_into(dst[:1], torch.tensor([1, 2]), 0)


def _rows(seq_lens: list[int], tables: list[list[int]]) -> dict[str, torch.Tensor]:
    """A decode step's per-row tensors: token 100+i at its last position, slot 10*(i+1)."""
    width = max(len(t) for t in tables)
    n = len(seq_lens)
    return dict(
        input_ids=torch.arange(100, 100 + n),
        positions=torch.tensor([s - 1 for s in seq_lens]),
        slot_mapping=torch.tensor([10 * (i + 1) for i in range(n)]),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
    )


def test_fill_copies_rows_and_pads_the_rest_of_the_bucket_in_place():
    buf = StaticDecodeInputs.allocate(8, max_blocks_per_seq=4, device="cpu")
    ptrs = [t.data_ptr() for t in (buf.input_ids, buf.slot_mapping, buf.block_tables)]
    buf.fill(4, **_rows([6, 3, 9], [[5, 2], [7], [1, 3, 4]]))
    assert buf.input_ids[:4].tolist() == [100, 101, 102, PAD_TOKEN_ID]
    assert buf.positions[:4].tolist() == [5, 2, 8, PAD_POSITION]
    assert buf.slot_mapping[:4].tolist() == [10, 20, 30, PAD_SLOT]
    assert buf.seq_lens[:4].tolist() == [6, 3, 9, PAD_SEQ_LEN]
    assert buf.block_tables[:4, :3].tolist() == [[5, 2, 0], [7, 0, 0], [1, 3, 4], [PAD_BLOCK] * 3]
    assert buf.query_start_loc.tolist() == list(range(9))
    # Fixed addresses: a captured graph reads the same tensors every step.
    assert [t.data_ptr() for t in (buf.input_ids, buf.slot_mapping, buf.block_tables)] == ptrs


def test_refill_with_fewer_rows_leaves_no_stale_rows_in_the_bucket():
    buf = StaticDecodeInputs.allocate(4, max_blocks_per_seq=4, device="cpu")
    buf.fill(4, **_rows([6, 3, 9, 2], [[5, 2], [7], [1, 3], [8]]))
    buf.fill(4, **_rows([7], [[5, 2]]))
    assert buf.slot_mapping.tolist() == [10, PAD_SLOT, PAD_SLOT, PAD_SLOT]
    assert buf.seq_lens.tolist() == [7, 1, 1, 1]
    assert buf.block_tables[:, :2].tolist() == [[5, 2], [0, 0], [0, 0], [0, 0]]


def test_fill_rejects_batches_and_block_tables_that_do_not_fit():
    buf = StaticDecodeInputs.allocate(2, max_blocks_per_seq=2, device="cpu")
    with pytest.raises(ValueError, match="do not fit"):
        buf.fill(2, **_rows([3, 3, 3], [[1], [2], [3]]))
    with pytest.raises(ValueError, match="do not fit"):
        buf.fill(4, **_rows([3], [[1]]))  # bucket larger than the buffers
    with pytest.raises(ValueError, match="columns"):
        buf.fill(1, **_rows([9], [[1, 2, 3]]))


def test_fill_padding_makes_the_bucket_all_padding():
    buf = StaticDecodeInputs.allocate(4, max_blocks_per_seq=3, device="cpu")
    buf.fill(4, **_rows([6, 3], [[5, 2], [7]]))
    buf.fill_padding(4)
    assert buf.slot_mapping.tolist() == [PAD_SLOT] * 4
    assert buf.seq_lens.tolist() == [PAD_SEQ_LEN] * 4
    assert buf.block_tables.tolist() == [[PAD_BLOCK] * 3] * 4
