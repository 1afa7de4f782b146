"""KV cache sizing rules: CPU size in GiB, explicit counts, GPU memory-fraction arithmetic."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.worker.kv_sizing import (
    KVGeometry,
    num_blocks_for_cpu,
    num_blocks_for_gpu,
    profile_requests,
)

GEOM = KVGeometry(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    assert GEOM.bytes_per_block == 2 * 2 * 16 * 2 * 64 * 4


def test_cpu_blocks_from_gib_or_explicit_count():
    assert num_blocks_for_cpu(CacheConfig(cpu_kv_cache_gib=1.0), GEOM) == (1 << 30) // 32768
    assert num_blocks_for_cpu(CacheConfig(num_kv_blocks=7), GEOM) == 7


def test_gpu_blocks_fill_the_fraction_after_weights_and_activations():
    total, used, peak = 100 << 30, 10 << 30, 5 << 30
    n = num_blocks_for_gpu(CacheConfig(memory_fraction=0.5), GEOM, total, used, peak)
    assert n == ((50 << 30) - used - peak) // GEOM.bytes_per_block


def test_gpu_fraction_with_no_room_names_the_key():
    with pytest.raises(ValueError, match="cache.memory_fraction"):
        num_blocks_for_gpu(CacheConfig(memory_fraction=0.1), GEOM, 100 << 30, 20 << 30, 0)


def test_profile_step_spreads_the_budget_over_max_num_seqs_requests():
    lens = profile_requests(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100), 1000)
    assert lens == [25, 25, 25, 25]
    # Requests never reach max_model_len; the budget may then be only partly used.
    lens = profile_requests(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), 21)
    assert lens == [20, 20]
    lens = profile_requests(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=10), 100)
    assert lens == [1] * 10
