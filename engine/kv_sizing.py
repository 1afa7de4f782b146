"""How many KV blocks fit: an explicit count, a CPU size in GiB, or a GPU memory fraction.

On the GPU the budget is `memory_fraction * total` minus what is already allocated (the
weights) minus the activation peak of a profiling forward at `max_num_batched_tokens`,
measured by the runner and passed in as `activation_peak_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import CacheConfig

_GIB = 1 << 30


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


def num_blocks_for_cpu(cache: CacheConfig, geom: KVGeometry) -> int:
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    return max(1, int(cache.cpu_kv_cache_gib * _GIB) // geom.bytes_per_block)


def num_blocks_for_gpu(
    cache: CacheConfig,
    geom: KVGeometry,
    total_bytes: int,
    allocated_bytes: int,
    activation_peak_bytes: int,
) -> int:
    """Blocks that fit in `memory_fraction` of the device after weights and activations."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    budget = int(cache.memory_fraction * total_bytes) - allocated_bytes - activation_peak_bytes
    n = budget // geom.bytes_per_block
    if n < 1:
        raise ValueError(
            "cache.memory_fraction: leaves no room for the KV cache "
            f"(budget {budget / _GIB:.2f} GiB after weights and activations); raise it or "
            "lower scheduler.max_num_batched_tokens"
        )
    return int(n)
