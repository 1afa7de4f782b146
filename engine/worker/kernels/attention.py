"""The paged-attention and cache-write kernels (csrc/paged_attention.c, cache_write.c) from
torch tensors.

Used by the torch backend (engine/worker/attention/torch_paged.py) on the CPU: decode rows
read each request's K/V from its blocks in place instead of gathering them first, and every
step's new K/V rows go into their slots with one copy per row.
"""

from __future__ import annotations

import torch

from engine.worker.kernels.build import library

# Limits of the kernel's stack buffers (csrc/paged_attention.c); larger shapes use torch.
MAX_GROUP, MAX_BLOCK, MAX_HEAD_DIM, MAX_ACC = 64, 64, 512, 16384


def supports(q: torch.Tensor, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
    """Whether paged_attention can serve this layer's tensors."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and kv_cache.dtype in (torch.float32, torch.bfloat16)
        and kv_cache.is_contiguous()
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and num_heads // num_kv_heads * kv_cache.shape[4] <= MAX_ACC
        and kv_cache.shape[2] <= MAX_BLOCK
        and kv_cache.shape[4] <= MAX_HEAD_DIM
        and library() is not None
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D] fp32 or bf16, rows contiguous
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D] fp32/bf16, contiguous
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    q_rows: torch.Tensor,  # [N] int64: rows of q (and out) to compute
    reqs: torch.Tensor,  # [N] int64: each row's request (row of block_tables)
    pos: torch.Tensor,  # [N] int64: each row's position; it sees keys <= pos
    out: torch.Tensor,  # [T, H, D] q's dtype, written at q_rows only
    scale: float,
    window: int | None,
) -> None:
    lib = library()
    assert lib is not None, "call supports() first"
    H, D = q.shape[1], q.shape[2]
    assert out.dtype == q.dtype, "q and out share a dtype"
    Hkv, block_size = kv_cache.shape[3], kv_cache.shape[2]
    for t in (q, out):
        assert t.stride(2) == 1 and t.stride(1) == D, "q/out rows must be [H, D] contiguous"
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    rc = lib.paged_attention(
        q.data_ptr(), q.stride(0), int(q.dtype == torch.bfloat16), kv_cache.data_ptr(),
        int(kv_cache.dtype == torch.bfloat16),
        tables.data_ptr(), tables.stride(0), q_rows.data_ptr(), reqs.data_ptr(), pos.data_ptr(),
        q_rows.numel(), H, Hkv, D, block_size, int(window or 0), float(scale), out.data_ptr(),
        out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError("paged_attention: shape past the kernel's limits")


def prefill_attention(
    q: torch.Tensor,  # [T, H, D] fp32 or bf16, rows [H, D] contiguous
    k: torch.Tensor,  # [T, Hkv, D] q's dtype, rows [Hkv, D] contiguous
    v: torch.Tensor,  # [T, Hkv, D]
    out: torch.Tensor,  # [T, H, D] q's dtype, written at the chunks' rows only
    chunks: list[tuple[int, int]],  # (start, end) rows of q/k/v: each a whole context
    scale: float,
) -> bool:
    """Causal attention of each chunk over its own keys (csrc/prefill_attention.c), all in
    one call. False when the kernel does not serve this shape (no AVX-512 build, a head size
    not a multiple of 64): the caller attends them another way."""
    lib = library()
    H, D, Hkv = q.shape[1], q.shape[2], k.shape[1]
    if lib is None or not chunks or D % 64 or H % Hkv or not q.dtype == k.dtype == v.dtype:
        return False
    assert out.dtype == q.dtype and q.dtype in (torch.float32, torch.bfloat16)
    for t in (q, k, v, out):
        assert t.stride(2) == 1 and t.stride(1) == D, "rows must be [heads, D] contiguous"
    bounds = torch.tensor(chunks, dtype=torch.int64).reshape(-1, 2)
    starts = bounds[:, 0].contiguous()
    lens = (bounds[:, 1] - bounds[:, 0]).contiguous()
    rc = lib.prefill_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        out.data_ptr(), out.stride(0), starts.data_ptr(), lens.data_ptr(), len(chunks), H, Hkv,
        D, float(scale), int(q.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if rc == -2:
        raise MemoryError("prefill_attention: no memory for a chunk's scratch")
    return rc == 0


def can_write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `write_kv` can store these rows (CPU, one dtype, unit inner strides)."""
    return (
        k.device.type == "cpu"
        and k.dtype == v.dtype == kv_cache.dtype
        and kv_cache.is_contiguous()
        and all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        and library() is not None
    )


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D], rows [Hkv, D] contiguous
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D], k's dtype, contiguous
    slots: torch.Tensor,  # [>= T] int64; -1 = do not store
) -> None:
    """cache[s // bs, 0, s % bs] = k[t] and cache[.., 1, ..] = v[t] for each token's slot s."""
    lib = library()
    assert lib is not None, "call can_write_kv() first"
    T = k.shape[0]
    slots = slots if slots.dtype == torch.long and slots.is_contiguous() else slots.long()
    assert slots.numel() >= T
    lib.write_kv(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kv_cache.data_ptr(),
        slots.data_ptr(), T, k.shape[1] * k.shape[2], kv_cache.shape[2], k.element_size(),
        torch.get_num_threads(),
    )  # fmt: skip
