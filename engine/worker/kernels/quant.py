"""The block-quantized linear kernel (csrc/quant_linear.c) from torch tensors.

`linear(x, data, kind, cols, bias)` multiplies fp32 rows by a weight in q4 or q8 blocks
(engine/worker/quant/blocks.py) without dequantizing it in memory; the caller converts
bf16 activations. `available()` says whether the library loaded.
"""

from __future__ import annotations

import torch

from engine.worker.kernels.build import library

# `int8_activations` -> the library function.
_KERNELS = {
    None: lambda lib: lib.quant_linear,
    "dot": lambda lib: lib.quant_linear_i8,
    "rounded": lambda lib: lib.quant_linear_rounded,
}


def available() -> bool:
    return library() is not None


def linear(
    x: torch.Tensor,  # [M, K] fp32, unit inner stride
    data: torch.Tensor,  # uint8 [N, K / 32 * block bytes]
    kind: int,  # 4 (q4) or 8 (q8)
    cols: int,  # K
    bias: torch.Tensor | None,  # fp32 [N]
    int8_activations: str | None = None,
) -> torch.Tensor:  # [M, N] fp32
    """`int8_activations`: None, csrc/quant_linear.c (fp32 products); "dot", the integer
    dot products of csrc/quant_linear_i8.c (x quantized per 32-value block); "rounded", x
    rounded the same way, then the fp32 products (the caller picks by row count)."""
    lib = library()
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], data.shape[0]
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


def dequantize_into(data: torch.Tensor, kind: int, cols: int, out: torch.Tensor) -> torch.Tensor:
    """Blocks -> `out` [N, K] (contiguous, fp32 or bf16: rounded to nearest even), returned."""
    lib = library()
    fn = lib.quant_dequantize_bf16 if out.dtype == torch.bfloat16 else lib.quant_dequantize
    fn(data.data_ptr(), kind, data.shape[0], cols, out.data_ptr(), torch.get_num_threads())
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
    ):
        self._keep = (data, bias)  # the pointers below stay valid while these live
        self._fn = _KERNELS[int8_activations](library())
        self._args = (data.data_ptr(), kind, data.shape[0], cols,
                      bias.data_ptr() if bias is not None else None)  # fmt: skip
        self.out_features = data.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] fp32, unit inner stride
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        w, kind, n, k, b = self._args
        self._fn(x.data_ptr(), x.stride(0), w, kind, n, k, b, y.data_ptr(), n, m,
                 torch.get_num_threads())  # fmt: skip
        return y
