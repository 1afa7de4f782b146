"""The KV cache's element type (`cache.kv_dtype`) and how K/V get into fp8 pages.

    kv_cache_dtype(setting, model_dtype)   auto -> the model's dtype; fp8_e4m3 -> e4m3fn
    is_fp8(dtype)                          a one-byte float page type
    new_kv_cache(shape, dtype, device)     zeroed pages (fp8: zeroed bytes, viewed as e4m3)
    page_bytes(cache)                      a uint8 view of fp8 pages, the cache itself else
    to_page_values(x, dtype)               x as the page stores it (fp8: e4m3 bytes)

fp8 pages (FlashInfer only, docs/quantization.md "fp8 KV pages"): each K/V element is stored
as e4m3 with a scale of 1 (FlashInfer's default `k_scale` / `v_scale`, which are left unset),
so the stored value is x itself, rounded to 3 mantissa bits and saturated at +-448 (e4m3fn
has no infinity: an unsaturated cast of a larger value is NaN on some builds). Rounding is
at most 2**-4 of |x| for |x| >= 2**-6, and at most 2**-10 absolute below (subnormals);
values under 2**-10 become 0. No per-tensor scale: a static scale only helps values beyond
448 (saturated) or far below 2**-6, and Llama-family K (after RoPE) and V are of order
0.1-20; the GPU check records the largest |K|/|V| and the share below 2**-6 on the model it
runs. FlashInfer widens e4m3 to the query's dtype (exact in bf16 and fp16) before the
products, so queries and outputs stay bf16/fp16.

Pages are written and copied through uint8 views (`page_bytes`): indexing and `index_put_`
on float8 tensors are not implemented by every torch build (SGLang stores fp8 KV as uint8
for the same reason); the bytes are the e4m3 values either way.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
_SETTINGS = {"fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pages' element type for `cache.kv_dtype` (validated by CacheConfig)."""
    return model_dtype if setting == "auto" else _SETTINGS[setting]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def new_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Zeroed pages of `dtype` (fp8: zeroed bytes viewed as e4m3, whose zero is all-zero bits)."""
    if is_fp8(dtype):
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def page_bytes(cache: torch.Tensor) -> torch.Tensor:
    """fp8 pages as uint8 (same shape and bytes) for indexing and copies; other caches as is."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x in e4m3 with scale 1: rounded to nearest, saturated at +-448."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def to_page_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as pages of `dtype` store it, in `page_bytes`' dtype (fp8: uint8 bytes of e4m3)."""
    if is_fp8(dtype):
        return to_fp8(x).view(torch.uint8)
    return x.to(dtype)
