"""The block-quantized linear kernels (csrc/quant_linear*.c) from torch tensors.

`linear(x, data, kind, cols, bias)` multiplies fp32 rows by a weight in q4, q8 or q4
column-group blocks (engine/worker/quant/blocks.py) without dequantizing it in memory;
`linear_bf16` takes and returns bf16 rows (fp32 inside, one rounding). `available()` says
whether the library loaded, `bf16_native()` whether the column-group kernel multiplies bf16
rows as they are (VDPBF16PS on AMD, exact int16 planes and VPDPWSSD on Intel; else they are
widened to fp32 inside the C call).
"""

from __future__ import annotations

import torch

from engine.worker.kernels.build import library

Q4G_KIND = 16  # csrc/quant_q4g.h (engine/worker/quant/blocks.py: Q4G)

# `int8_activations` -> the library function.
_KERNELS = {
    None: lambda lib: lib.quant_linear,
    "dot": lambda lib: lib.quant_linear_i8,
    "rounded": lambda lib: lib.quant_linear_rounded,
}


def available() -> bool:
    return library() is not None


def bf16_native() -> bool:
    lib = library()
    return lib is not None and bool(lib.q4g_bf16_native())


def _out_rows(data: torch.Tensor, kind: int, rows: int | None) -> int:
    """Output features: the data's rows, except for column groups (16 per row of data)."""
    if rows is not None:
        return rows
    if kind == Q4G_KIND:
        raise ValueError("column-group data needs its row count")
    return data.shape[0]


def linear(
    x: torch.Tensor,  # [M, K] fp32, unit inner stride
    data: torch.Tensor,  # uint8 [N, K / 32 * block bytes]
    kind: int,  # 4 (q4) or 8 (q8)
    cols: int,  # K
    bias: torch.Tensor | None,  # fp32 [N]
    int8_activations: str | None = None,
    rows: int | None = None,  # N; required for column groups
) -> torch.Tensor:  # [M, N] fp32
    """`int8_activations`: None, csrc/quant_linear.c (fp32 products); "dot", the integer
    dot products of csrc/quant_linear_i8.c (x quantized per 32-value block); "rounded", x
    rounded the same way, then the fp32 products (the caller picks by row count)."""
    lib = library()
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], _out_rows(data, kind, rows)
    y = torch.empty(m, n, dtype=torch.float32)
    fn = _KERNELS[int8_activations](lib)
    rc = fn(
        x.data_ptr(), x.stride(0), data.data_ptr(), kind, n, cols,
        bias.data_ptr() if bias is not None else None, y.data_ptr(), n, m,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"quant_linear failed ({rc}): K={cols} must be a multiple of 32")
    return y


def linear_bf16(
    x: torch.Tensor,  # [M, K] bf16
    data: torch.Tensor,
    kind: int,
    cols: int,
    bias: torch.Tensor | None,  # fp32 [N]
    rows: int | None = None,
) -> torch.Tensor:  # [M, N] bf16
    """bf16 rows through the blocks: fp32 products and bias, the result rounded once."""
    lib = library()
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], _out_rows(data, kind, rows)
    y = torch.empty(m, n, dtype=torch.bfloat16)
    rc = lib.quant_linear_bf16(
        x.data_ptr(), x.stride(0), data.data_ptr(), kind, n, cols,
        bias.data_ptr() if bias is not None else None, y.data_ptr(), n, m,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"quant_linear_bf16 failed ({rc}): K={cols} must be a multiple of 32")
    return y


def dequantize_into(data: torch.Tensor, kind: int, cols: int, out: torch.Tensor) -> torch.Tensor:
    """Blocks -> `out` [N, K] (contiguous, fp32 or bf16: rounded to nearest even), returned."""
    lib = library()
    fn = lib.quant_dequantize_bf16 if out.dtype == torch.bfloat16 else lib.quant_dequantize
    fn(data.data_ptr(), kind, out.shape[0], cols, out.data_ptr(), torch.get_num_threads())
    return out


def dequantize_t_into(data: torch.Tensor, cols: int, out: torch.Tensor) -> torch.Tensor:
    """q4 column groups -> `out` = W^T [K, N] (contiguous, fp32 or bf16), returned: the
    layout writes the transposed copy 16 columns at a time (W^T.t() is the [N, K] weight)."""
    library().q4g_dequantize_t(
        data.data_ptr(), out.shape[1], cols, out.data_ptr(), int(out.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


class BoundLinear:
    """`linear` for one fixed weight: the library function, the weight's and bias's
    pointers and sizes bound once, so a decode step's call is one allocation and one
    ctypes call (a batch-1 step makes ~120 of them on SmolLM2)."""

    def __init__(
        self,
        data: torch.Tensor,
        kind: int,
        cols: int,
        bias: torch.Tensor | None,
        int8_activations: str | None = None,  # as in `linear`
        rows: int | None = None,  # as in `linear`
    ):
        self._keep = (data, bias)  # the pointers below stay valid while these live
        lib = library()
        self._fn = _KERNELS[int8_activations](lib)
        self._fn_bf16 = lib.quant_linear_bf16
        n = _out_rows(data, kind, rows)
        self._args = (data.data_ptr(), kind, n, cols,
                      bias.data_ptr() if bias is not None else None)  # fmt: skip
        self.out_features = n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] fp32, unit inner stride
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        w, kind, n, k, b = self._args
        self._fn(x.data_ptr(), x.stride(0), w, kind, n, k, b, y.data_ptr(), n, m,
                 torch.get_num_threads())  # fmt: skip
        return y

    def bf16(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] bf16, unit inner stride
        """bf16 rows in and out (the fp32 products rounded once; int8 kernels excluded)."""
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.bfloat16)
        w, kind, n, k, b = self._args
        self._fn_bf16(x.data_ptr(), x.stride(0), w, kind, n, k, b, y.data_ptr(), n, m,
                      torch.get_num_threads())  # fmt: skip
        return y
