"""The one place torch.compile is applied, and with which options.

`compile_dynamic(fn)` compiles a callable with dynamic shapes, so one set of compiled graphs
serves every token count. Dynamo specialises sizes 0 and 1, so a call with a dimension of
exactly one compiles once more; after that nothing recompiles (the engine's model wrapper,
`engine/worker/compiled_model.py`, and its test count). `run_eagerly(fn)` marks a function
dynamo must not trace: compiled code calls it as a graph break, so Python planning inside
it (host lists, per-step caches) runs every call and never becomes a guard or a recompile.

The inductor cache directory is exported as `TORCHINDUCTOR_CACHE_DIR` when something is
compiled, not at import time, so a restarted server reuses compiled kernels.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

F = TypeVar("F", bound=Callable[..., Any])


def set_compile_cache_dir(path: str | None) -> str | None:
    """Point inductor's on-disk cache at `path` (created if missing); returns the dir in use."""
    if path:
        resolved = str(Path(path).expanduser().resolve())
        Path(resolved).mkdir(parents=True, exist_ok=True)
        os.environ[CACHE_ENV] = resolved
        return resolved
    return os.environ.get(CACHE_ENV)


def compile_dynamic(
    fn: Callable[..., Any],
    *,
    cache_dir: str | None = None,
    backend: str | Callable = "inductor",
    **options: Any,
) -> Callable[..., Any]:
    """`torch.compile(fn, dynamic=True)`, inductor's cache in `cache_dir` (None: as set).

    dynamic=True rather than mark_dynamic on one dimension: each graph break starts a new
    frame (resume functions, nested calls) whose inputs cannot be marked, and would otherwise
    compile static first and dynamic on a second size. `backend` and `options` go to
    torch.compile (tests pass a counting backend).
    """
    in_use = set_compile_cache_dir(cache_dir)
    logger.info("torch.compile %s (dynamic shapes); cache dir %s", _name(fn), in_use)
    return torch.compile(fn, backend=backend, dynamic=True, **options)


def run_eagerly(fn: F) -> F:
    """`fn` excluded from torch.compile: compiled callers break the graph around it."""
    return torch.compiler.disable(fn)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)
