"""Copies one KV block (every layer) between the pool's caches and host memory.

On the CPU the pool is host memory already: a copy is a `copy_` per layer, run on the tier's
worker thread (torch releases the GIL), never on the engine thread. On CUDA the copies run on
a copy stream of their own into pinned buffers, so they overlap the model's kernels: a save
first waits for a fence event recorded on the compute stream when the step named it (the
block's last writes are done by then), and the worker thread waits for the copy stream before
it reports the block copied or loaded, so nothing reads a load early or reuses a block that
is still being read.

A host buffer for one block is `[num_layers, 2, block_size, kv_heads, head_dim]`, the layout
of the disk tier's payload.
"""

from __future__ import annotations

from typing import Any

import torch


class BlockCopier:
    def __init__(self, kv_caches: list[torch.Tensor], device: torch.device):
        self.kv = kv_caches
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream: Any = None

    @property
    def block_shape(self) -> tuple[int, ...]:
        """A host block buffer's shape."""
        return (len(self.kv), *self.kv[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.kv[0].dtype

    def _copy_stream(self) -> Any:
        if self._stream is None:  # created lazily, on first use (CUDA only)
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def fence(self) -> Any:
        """Engine thread, when a step names saves: an event after the compute stream's work
        so far (CUDA), or None (CPU: that work is done when the step returns)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy_out(self, block_id: int, dst: torch.Tensor, fence: Any = None) -> None:
        """Pool block -> host buffer; returns when the copy is done."""
        if not self.cuda:
            for layer, cache in enumerate(self.kv):
                dst[layer].copy_(cache[block_id])
            return
        stream = self._copy_stream()
        with torch.cuda.stream(stream):
            if fence is not None:
                stream.wait_event(fence)
            for layer, cache in enumerate(self.kv):
                dst[layer].copy_(cache[block_id], non_blocking=True)
        stream.synchronize()

    def copy_in(self, src: torch.Tensor, block_id: int) -> None:
        """Host buffer -> pool block; returns when the copy is done."""
        if not self.cuda:
            for layer, cache in enumerate(self.kv):
                cache[block_id].copy_(src[layer])
            return
        stream = self._copy_stream()
        with torch.cuda.stream(stream):
            for layer, cache in enumerate(self.kv):
                cache[block_id].copy_(src[layer], non_blocking=True)
        stream.synchronize()
