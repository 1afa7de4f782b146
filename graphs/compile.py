"""The one place torch.compile is applied to a model, and with which options.

`maybe_compile(model, runtime)` returns the model unchanged when `runtime.compile` is off,
else a `CompiledModel` whose forward is compiled with dynamic shapes, so one set of compiled
graphs serves every token count. Dynamo specialises sizes 0 and 1, so a step of exactly one
token compiles once more; after one multi-token step and one single-token step nothing
recompiles (tests/graphs/test_compile.py counts). Weights keep static shapes.

Attention stays outside the compiled region: the backend seen by the compiled code is an
`EagerAttention` proxy whose `forward` is `torch.compiler.disable`d. Dynamo breaks the graph
around each attention call, so a backend's Python planning (FlashInfer `plan()` arrays,
per-step caches, host lists) runs eagerly every step and never becomes a guard or a
recompile, and CUDA graphs captured over the compiled model still replay FlashInfer's own
kernels with the plan made before each replay.

The inductor cache directory (`runtime.compile_cache_dir`) is exported as
`TORCHINDUCTOR_CACHE_DIR` when the model is compiled, not at import time, so a restarted
server reuses compiled kernels.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import RuntimeConfig
from engine.worker.attention.base import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
    ForwardContext,
)

logger = logging.getLogger(__name__)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


class EagerAttention(AttentionBackend):
    """Delegates to a backend; `forward` is excluded from torch.compile (a graph break)."""

    def __init__(self, inner: AttentionBackend):
        self.inner = inner
        self.name = inner.name

    def begin_step(self, metadata: AttentionMetadata) -> None:
        self.inner.begin_step(metadata)

    @torch.compiler.disable
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

    def __init__(self, model: nn.Module, backend: str | Callable = "inductor", **options: Any):
        super().__init__()
        self.model = model
        # dynamic=True rather than mark_dynamic on the token dim: each attention graph break
        # starts a new frame (resume functions, layer forwards) whose inputs cannot be
        # marked, and would otherwise compile static first and dynamic on a second size.
        self._compiled = torch.compile(model.forward, backend=backend, dynamic=True, **options)
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["model"], name)


def set_compile_cache_dir(path: str | None) -> str | None:
    """Point inductor's on-disk cache at `path` (created if missing); returns the dir in use."""
    if path:
        resolved = str(Path(path).expanduser().resolve())
        Path(resolved).mkdir(parents=True, exist_ok=True)
        os.environ[CACHE_ENV] = resolved
        return resolved
    return os.environ.get(CACHE_ENV)


def maybe_compile(model: nn.Module, runtime: RuntimeConfig, **options: Any) -> nn.Module:
    """`model` itself when `runtime.compile` is off, else a `CompiledModel` around it.

    `options` go to torch.compile (tests pass a counting `backend=`).
    """
    if not runtime.compile:
        return model
    cache_dir = set_compile_cache_dir(runtime.compile_cache_dir)
    logger.info("torch.compile on (dynamic token dim, attention eager); cache dir %s", cache_dir)
    return CompiledModel(model, **options)
