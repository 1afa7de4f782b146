"""Bucket sizes, bucket choice and the padding of a decode step into static buffers."""

from __future__ import annotations

import pytest
import torch

from engine.config import RuntimeConfig
from graphs.buckets import (
    PAD_BLOCK,
    PAD_SEQ_LEN,
    PAD_SLOT,
    StaticDecodeInputs,
    capture_sizes,
    pad_into,
    pick_bucket,
)
from tests.support.paged_harness import build_metadata


def test_default_capture_sizes_are_powers_then_multiples_of_eight():
    sizes = capture_sizes(None, 256)
    assert sizes[:5] == (1, 2, 4, 8, 16)
    assert sizes[-1] == 256
    assert len(sizes) == 3 + 32
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:], strict=False))


def test_capture_sizes_are_trimmed_to_max_num_seqs():
    assert capture_sizes(None, 20) == (1, 2, 4, 8, 16)
    assert capture_sizes(None, 1) == (1,)


def test_configured_capture_sizes_win_sorted_and_unique():
    rt = RuntimeConfig(capture_sizes=(16, 4, 4, 1, 512))
    assert capture_sizes(rt.capture_sizes, 64) == (1, 4, 16)
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


def _decode_step(seq_lens, tables, block_size=4):
    md = build_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
    ids = torch.arange(100, 100 + len(seq_lens))
    return ids, md


def test_fill_pads_tokens_positions_slots_and_metadata():
    buf = StaticDecodeInputs.allocate(8, max_blocks_per_seq=4, device="cpu")
    ids, md = _decode_step([6, 3, 9], [[5, 2], [7], [1, 3, 4]])
    padded = buf.fill(ids, md.positions, md, bucket=4)
    assert buf.input_ids[:4].tolist() == [100, 101, 102, 0]
    assert buf.positions[:4].tolist() == [5, 2, 8, 0]
    # slots: 2*4+1, 7*4+2, 4*4+0, then padding writes nowhere
    assert buf.slot_mapping[:4].tolist() == [9, 30, 16, PAD_SLOT]
    assert buf.seq_lens[:4].tolist() == [6, 3, 9, PAD_SEQ_LEN]
    assert padded.block_tables.tolist() == [[5, 2, 0], [7, 0, 0], [1, 3, 4], [PAD_BLOCK] * 3]
    assert (padded.num_reqs, padded.num_tokens, padded.max_query_len) == (4, 4, 1)
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert padded.query_start_loc_cpu == [0, 1, 2, 3, 4]
    assert padded.seq_lens_cpu == [6, 3, 9, 1]
    assert padded.max_seq_len == 9 and padded.block_size == 4
    # Views of the static buffers, so a captured graph sees every step's values.
    assert padded.slot_mapping.data_ptr() == buf.slot_mapping.data_ptr()
    assert padded.block_tables.data_ptr() == buf.block_tables.data_ptr()


def test_fill_full_width_exposes_every_static_column():
    buf = StaticDecodeInputs.allocate(4, max_blocks_per_seq=6, device="cpu")
    ids, md = _decode_step([6], [[5, 2]])
    padded = buf.fill(ids, md.positions, md, bucket=2, full_width=True)
    assert padded.block_tables.shape == (2, 6)
    assert padded.block_tables[:, :2].tolist() == [[5, 2], [0, 0]]


def test_refill_with_a_smaller_batch_leaves_no_stale_rows_in_the_bucket():
    buf = StaticDecodeInputs.allocate(4, max_blocks_per_seq=4, device="cpu")
    ids, md = _decode_step([6, 3, 9, 2], [[5, 2], [7], [1, 3, 4], [8]])
    buf.fill(ids, md.positions, md, bucket=4)
    ids, md = _decode_step([7], [[5, 2]])
    padded = buf.fill(ids, md.positions, md, bucket=4)
    assert buf.slot_mapping.tolist() == [10, PAD_SLOT, PAD_SLOT, PAD_SLOT]
    assert padded.block_tables.tolist() == [[5, 2], [0, 0], [0, 0], [0, 0]]
    assert padded.seq_lens.tolist() == [7, 1, 1, 1]


def test_fill_rejects_prefill_steps_and_oversized_batches():
    buf = StaticDecodeInputs.allocate(2, max_blocks_per_seq=2, device="cpu")
    md = build_metadata([2], [5], [[1, 2]], 4)
    with pytest.raises(ValueError, match="decode-only"):
        buf.fill(torch.tensor([1, 2]), md.positions, md, bucket=2)
    ids, md = _decode_step([3, 3, 3], [[1], [2], [3]])
    with pytest.raises(ValueError, match="do not fit"):
        buf.fill(ids, md.positions, md, bucket=2)
    ids, md = _decode_step([9], [[1, 2, 3]])
    with pytest.raises(ValueError, match="columns"):
        buf.fill(ids, md.positions, md, bucket=1)


def test_dummy_batch_is_all_padding():
    buf = StaticDecodeInputs.allocate(4, max_blocks_per_seq=3, device="cpu")
    md = buf.dummy(4, block_size=16)
    assert md.slot_mapping.tolist() == [PAD_SLOT] * 4
    assert md.seq_lens_cpu == [1, 1, 1, 1]
    assert md.block_tables.shape == (4, 3)
    assert md.is_decode_only
