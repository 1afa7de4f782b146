"""Rotary position embeddings (NeoX / HF "rotate_half" layout) with llama3 and linear scaling.

The inverse frequencies are computed exactly as transformers does (same fp32 ops), so fp32
logits match the reference bit for bit up to matmul ordering. cos/sin are precomputed for
every position up to `max_position_embeddings` and gathered by position in the forward,
which keeps the forward free of data-dependent shapes (CUDA-graph friendly).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a config as one dict with `rope_type` and `rope_theta`.

    transformers 5 writes `rope_parameters` (theta inside); older checkpoints carry
    `rope_scaling` (maybe None, maybe with the legacy key `type`) next to `rope_theta`.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and "full_attention" in params:
        params = params["full_attention"]  # per-layer-type dicts: take the full-attention one
    if not isinstance(params, dict) or not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    else:
        params = dict(params)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = float(getattr(hf_config, "rope_theta", None) or 10000.0)
    return params


def compute_inv_freq(params: dict[str, Any], head_dim: int, max_position: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 for the given rope parameters."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    base = params["rope_theta"]
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq /= params["factor"]
    elif rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params.get("original_max_position_embeddings", max_position)
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, inv_freq_llama)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_position, head_dim] in float32, gathered by position."""

    def __init__(self, hf_config: Any, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = int(hf_config.max_position_embeddings)
        self.params = rope_parameters(hf_config)
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        # the tables in other dtypes, converted on first use; emptied by every build
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.build(self.cos_cache.device)

    def build(self, device: torch.device) -> None:
        """(Re)compute the tables on `device`.

        The loader builds models on the meta device and calls this after `to_empty`, which
        leaves buffers uninitialized. On meta it only records shapes.
        """
        inv_freq = compute_inv_freq(self.params, self.head_dim, self.max_position)
        if device.type == "meta":
            shape = (self.max_position, self.head_dim)
            self.cos_cache = torch.empty(shape, device=device)
            self.sin_cache = torch.empty(shape, device=device)
            return
        pos = torch.arange(self.max_position, dtype=torch.float, device=device)
        freqs = pos[:, None] * inv_freq.to(device)[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos_cache = emb.cos()
        self.sin_cache = emb.sin()
        self._tables = {}

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (cos, sin) tables in `dtype`, converted once (the fused kernel reads them
        in the activations' dtype, as transformers casts cos/sin to it)."""
        if dtype == self.cos_cache.dtype:
            return self.cos_cache, self.sin_cache
        if dtype not in self._tables:
            self._tables[dtype] = (self.cos_cache.to(dtype), self.sin_cache.to(dtype))
        return self._tables[dtype]

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin) each [T, 1, head_dim] in `dtype`."""
        cos = self.cos_cache.index_select(0, positions).to(dtype)
        sin = self.sin_cache.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos/sin [T, 1, D], in x's dtype like transformers."""
    return (x * cos) + (_rotate_half(x) * sin)
