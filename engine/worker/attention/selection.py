"""Which attention backend a model runs: FlashInfer where asked for and able (probed on the
model's layers), else the torch backend, and why, for the runner's status and start-up log.

`select_attention_backend` is the rule (runtime.attention_backend, cache.kv_dtype); the model
runner and a draft model call it, and it fails with `ConfigError` where no backend can serve
what was configured.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ConfigError
from engine.worker.attention.base import AttentionBackend, AttentionLayerSpec
from engine.worker.attention.kv_dtype import is_fp8
from engine.worker.status import describe_error

logger = logging.getLogger(__name__)


@dataclass
class AttentionChoice:
    backend: AttentionBackend
    # Why FlashInfer was wanted (auto, on CUDA) but not used; None when it runs or was not
    # wanted (the CPU, or runtime.attention_backend: torch).
    fallback_reason: str | None = None


def select_attention_backend(
    device: torch.device,
    dtype: torch.dtype,
    cpu_kernels: bool = True,
    *,
    setting: str = "auto",
    specs: Sequence[AttentionLayerSpec] = (),
    block_size: int = 16,
    flashinfer_module: Any = None,
    kv_dtype: torch.dtype | None = None,
) -> AttentionChoice:
    """The attention backend for `setting` (runtime.attention_backend).

    FlashInfer is tried with `flashinfer` always and with `auto` on CUDA (or wherever a
    stand-in `flashinfer_module` is given, as tests do): it must be importable as a 0.7.x
    release, take the model's dtype, and pass `probe_attention` over `specs` (the model's
    layers) with `block_size`. Under `auto` any failure falls back to the torch backend with
    the reason logged and returned; under `flashinfer` it raises `ConfigError` naming
    runtime.attention_backend with that reason.

    `kv_dtype`: the pages' dtype (default `dtype`). fp8 pages are read by FlashInfer only, so
    there is no fallback then: the torch backend (chosen, or the only one left) is refused
    with a `ConfigError` naming cache.kv_dtype and the reason.
    """
    from engine.worker.attention.torch_paged import TorchPagedBackend

    fp8_pages = kv_dtype is not None and is_fp8(kv_dtype)
    wanted = setting == "flashinfer" or (
        setting == "auto" and (device.type == "cuda" or flashinfer_module is not None)
    )
    if not wanted:
        if fp8_pages:
            why = "runtime.attention_backend is torch" if setting == "torch" else device.type
            raise ConfigError("cache.kv_dtype", f"{FP8_PAGES}; here the torch backend runs ({why})")
        return AttentionChoice(TorchPagedBackend(native=cpu_kernels))
    try:
        backend = _probed_flashinfer(device, dtype, specs, block_size, flashinfer_module, kv_dtype)
    except Exception as e:  # noqa: BLE001 - import, version, JIT, plan, run: all fall back
        reason = describe_error(e)
        if setting == "flashinfer":
            raise ConfigError(
                "runtime.attention_backend", f"flashinfer cannot run here: {reason}"
            ) from e
        if fp8_pages:  # nothing to fall back to: the torch backend reads no fp8 pages
            raise ConfigError("cache.kv_dtype", f"{FP8_PAGES}, which cannot run: {reason}") from e
        logger.warning(
            "attention falls back to the torch backend (runtime.attention_backend auto): %s",
            reason,
        )
        return AttentionChoice(TorchPagedBackend(native=cpu_kernels), reason)
    return AttentionChoice(backend)


FP8_PAGES = "fp8_e4m3 pages need the FlashInfer backend (CUDA; cache.kv_dtype auto runs anywhere)"


def _probed_flashinfer(
    device, dtype, specs, block_size, flashinfer_module, kv_dtype=None
) -> AttentionBackend:
    from engine.worker.attention.flashinfer import FlashInferBackend, FlashInferUnavailable
    from engine.worker.attention.probe import probe_attention

    backend = FlashInferBackend(device, flashinfer_module=flashinfer_module)
    if dtype not in backend.cache_dtypes:
        raise FlashInferUnavailable(
            f"FlashInfer runs fp16/bf16 caches, not {dtype}; set model.dtype auto or bfloat16"
        )
    probe_attention(backend, specs, block_size, dtype, device, kv_dtype)
    return backend
