"""Fused decoder-layer elementwise ops (csrc/fused_ops.c) from torch tensors.

`usable(*tensors)` says whether the fused path applies (CPU, fp32 or bf16, the library
loaded); the model falls back to its plain torch ops when it does not. Each wrapper takes
2-D row views and honours their row stride, so slices of a larger tensor need no copy. The
output has the input's dtype; in bf16 every tensor argument must be bf16 (the kernels widen
to fp32 inside and round where transformers' bf16 forward rounds).
"""

from __future__ import annotations

import torch

from engine.worker.kernels.build import library

DTYPES = (torch.float32, torch.bfloat16)


def usable(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype in DTYPES for t in tensors) and (
        library() is not None
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, n] with unit stride along n (a copy only if it has no such view)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _bf16(*tensors: torch.Tensor) -> int:
    """1 when the tensors are bf16, 0 when fp32; mixing the two is a caller bug."""
    dtype = tensors[0].dtype
    assert all(t.dtype == dtype for t in tensors), "fused ops take one dtype throughout"
    assert dtype in DTYPES, f"fused ops run fp32 or bf16, not {dtype}"
    return int(dtype == torch.bfloat16)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of (x + residual) with the sum written back into `residual` (when given).

    x, residual: [T, n]; weight: [n]. Returns a new [T, n] tensor."""
    lib = library()
    x2 = _rows(x)
    T, n = x2.shape
    w = weight.contiguous()
    bf16 = _bf16(x2, w) if residual is None else _bf16(x2, w, residual)
    out = torch.empty(T, n, dtype=x2.dtype)
    if residual is not None:
        assert residual.shape == x2.shape and residual.stride(-1) == 1 and residual.is_contiguous()
    lib.fused_add_rms_norm(
        x2.data_ptr(), x2.stride(0), residual.data_ptr() if residual is not None else None,
        n if residual is not None else 0, w.data_ptr(), float(eps), out.data_ptr(), n, T, n,
        torch.get_num_threads(), bf16,
    )  # fmt: skip
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate columns, then up) -> silu(gate) * up, [T, I]."""
    lib = library()
    g = _rows(gate_up)
    T, n2 = g.shape
    out = torch.empty(T, n2 // 2, dtype=g.dtype)
    lib.silu_and_mul(g.data_ptr(), g.stride(0), out.data_ptr(), n2 // 2, T, n2 // 2,
                     torch.get_num_threads(), _bf16(g))  # fmt: skip
    return out


def rope_inplace(
    x: torch.Tensor,  # [T, heads * D] view with unit inner stride (e.g. q and k of qkv)
    heads: int,
    head_dim: int,
    positions: torch.Tensor,  # [T] int64
    cos_table: torch.Tensor,  # [P, D], x's dtype
    sin_table: torch.Tensor,  # [P, D], x's dtype
) -> None:
    """Rotate `heads` heads of every row of x in place (transformers' rotate-half form)."""
    lib = library()
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == heads * head_dim
    pos = (
        positions
        if positions.dtype == torch.long and positions.is_contiguous()
        else (positions.long().contiguous())
    )
    assert cos_table.is_contiguous() and sin_table.is_contiguous()
    assert cos_table.shape[1] == head_dim
    lib.rope_inplace(x.data_ptr(), x.stride(0), heads, head_dim, pos.data_ptr(),
                     cos_table.data_ptr(), sin_table.data_ptr(), x.shape[0],
                     torch.get_num_threads(), _bf16(x, cos_table, sin_table))  # fmt: skip


def argmax_rows_bf16(x: torch.Tensor) -> torch.Tensor:
    """[N, V] bf16 (unit stride along V) -> int64 [N]: the argmax of each row, first index on
    ties, the first NaN if any (NumPy's rules), read in place without an fp32 copy."""
    lib = library()
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows_bf16(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    return out


def screen_rows_bf16(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    wn: torch.Tensor,
    wr: torch.Tensor,
    rel: float,
    cap: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates of each row of approximate logits x [N, V] bf16 (unit stride along V):
    every index whose exact logit may be the row's largest, the exact logit of index c in
    row r being within alpha[r] * wn[c] + beta[r] * wr[c] + rel * |x[r, c]| of x[r, c]
    (csrc/fused_ops.c, `screen_rows_bf16`). alpha, beta [N] and wn, wr [V]: fp32. Returns
    (idx [N, cap] int64, increasing, only the first count[r] of row r set; count [N] int64,
    -1 where a row has more than `cap` candidates, a NaN or an infinity)."""
    lib = library()
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1
    n, v = x.shape
    alpha, beta = (t.to(torch.float32).contiguous() for t in (alpha, beta))
    wn, wr = (t.to(torch.float32).contiguous() for t in (wn, wr))
    assert alpha.shape == beta.shape == (n,) and wn.shape == wr.shape == (v,)
    idx = torch.zeros(n, cap, dtype=torch.int64)
    count = torch.empty(n, dtype=torch.int64)
    lib.screen_rows_bf16(
        x.data_ptr(), x.stride(0), n, v, alpha.data_ptr(), beta.data_ptr(), wn.data_ptr(),
        wr.data_ptr(), rel, cap, idx.data_ptr(), count.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return idx, count
