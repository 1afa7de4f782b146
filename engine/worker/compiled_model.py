"""The model with a torch.compiled forward, its attention kept out of the compiled region.

`CompiledModel(model)` compiles `model.forward` through `graphs.compile.compile_dynamic`
(dynamic token dimension: after one multi-token step and one single-token step nothing
recompiles; tests/worker/test_compiled_model.py counts). Weights keep static shapes.

Attention stays outside the compiled region: the backend seen by the compiled code is an
`EagerAttention` proxy whose `forward` runs eagerly (`graphs.compile.run_eagerly`). Dynamo
breaks the graph around each attention call, so a backend's Python planning (FlashInfer
`plan()` arrays, per-step caches, host lists) runs eagerly every step and never becomes a
guard or a recompile, and CUDA graphs captured over the compiled model still replay
FlashInfer's own kernels with the plan made before each replay.

`ModelRunner` applies it (when `runtime.compile` is on); nothing else wraps the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.worker.attention.base import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
    ForwardContext,
)
from graphs.compile import compile_dynamic, run_eagerly


class EagerAttention(AttentionBackend):
    """Delegates to a backend; `forward` is excluded from torch.compile (a graph break)."""

    def __init__(self, inner: AttentionBackend):
        self.inner = inner
        self.name = inner.name

    def begin_step(self, metadata: AttentionMetadata) -> None:
        self.inner.begin_step(metadata)

    @run_eagerly
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        layer: AttentionLayerSpec,
    ) -> torch.Tensor:
        return self.inner.forward(q, k, v, kv_cache, metadata, layer)

    def __getattr__(self, name: str) -> Any:  # graph hooks etc. of the wrapped backend
        return getattr(self.inner, name)


class CompiledModel(nn.Module):
    """`model` with a compiled forward; everything else (compute_logits, attributes) as is."""

    def __init__(
        self,
        model: nn.Module,
        *,
        cache_dir: str | None = None,
        backend: str | Callable = "inductor",
        **options: Any,
    ):
        """`cache_dir`: inductor's on-disk cache (None: as the environment has it);
        `backend` and `options` go to torch.compile (tests pass a counting backend)."""
        super().__init__()
        self.model = model
        self._compiled = compile_dynamic(
            model.forward, cache_dir=cache_dir, backend=backend, **options
        )
        self._proxies: dict[int, EagerAttention] = {}

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, hidden]
        eager_ctx = ForwardContext(ctx.attn_metadata, ctx.kv_caches, self._proxy(ctx.backend))
        return self._compiled(input_ids, positions, eager_ctx)

    def _proxy(self, backend: AttentionBackend) -> EagerAttention:
        if isinstance(backend, EagerAttention):
            return backend
        proxy = self._proxies.get(id(backend))
        if proxy is None or proxy.inner is not backend:
            proxy = self._proxies[id(backend)] = EagerAttention(backend)
        return proxy

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        return self.model.compute_logits(hidden, keep_dtype)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["model"], name)
