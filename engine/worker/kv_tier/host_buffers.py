"""Host memory of the KV tiers: the host tier's slots and the staging buffers of disk writes.

Both are block buffers (`BlockCopier.block_shape`), pinned on CUDA so the copy stream moves
them asynchronously. Pinned memory is taken once, at start-up, for the whole host tier
(cache.host_tier_gib): pinning is slow and fragments if done per block.
"""

from __future__ import annotations

import queue

import torch


def _empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


class HostTierSlots:
    """`num_slots` block buffers in one tensor; the core's index assigns the slots."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        self.buffer = _empty((num_slots, *block_shape), dtype, pin)

    def slot(self, i: int) -> torch.Tensor:
        return self.buffer[i]


class StagingBuffers:
    """A bounded set of block buffers that disk writes read from once the pool's block is
    copied out (so the block is free again before the file is written)."""

    def __init__(self, count: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for _ in range(max(1, count)):
            self._free.put(_empty(block_shape, dtype, pin))

    def acquire(self, timeout: float) -> torch.Tensor | None:
        """A free buffer, or None after `timeout` seconds (every buffer is being written)."""
        try:
            return self._free.get(timeout=timeout) if timeout > 0 else self._free.get_nowait()
        except queue.Empty:
            return None

    def release(self, buf: torch.Tensor) -> None:
        self._free.put(buf)


def as_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, no copy (any dtype, bfloat16 included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def from_bytes(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `data`'s bytes, no copy."""
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)
