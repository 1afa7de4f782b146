"""bf16 linear layers on AMX tiles (csrc/amx_linear.c) from torch tensors.

    available()                     the library has AMX and this process may use the tiles
    supports(out_features, in_f)    shapes the kernel takes (N % 16 == 0, K % 32 == 0)
    pack(weight)                    a [N, K] bf16 weight in the kernel's tile layout
    linear(x, tiles, bias, N)       x [M, K] bf16 @ W^T (+ bias) -> [M, N] bf16

`APPLIANCE_AMX_LINEAR=off` makes `available()` False (oneDNN's packed GEMM then serves bf16
linears, as on CPUs without AMX): the switch the A/B benchmarks flip.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from engine.worker.kernels.build import library

logger = logging.getLogger(__name__)

ENV = "APPLIANCE_AMX_LINEAR"


@functools.cache
def available() -> bool:
    """Checked once a process: the switch, the CPU's flags, the build and the kernel's grant
    of AMX state to this process (requested here if no one did before)."""
    if os.environ.get(ENV, "auto").lower() in ("0", "off", "false", "no"):
        return False
    from engine.worker.cpu_features import detect_cpu_features

    lib = library()
    if lib is None or not detect_cpu_features().amx:
        return False
    if not lib.amx_bf16_ready():
        logger.info(
            "AMX tiles unavailable to this process (build or kernel); bf16 linears stay on oneDNN"
        )
        return False
    return True


def supports(out_features: int, in_features: int) -> bool:
    return out_features > 0 and out_features % 16 == 0 and in_features > 0 and in_features % 32 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] bf16 weight as blocks of 16 columns x 32 values (1 KiB each, flat bf16)."""
    assert weight.dtype == torch.bfloat16 and weight.dim() == 2
    n, k = weight.shape
    assert supports(n, k), f"AMX tiles need N % 16 == 0 and K % 32 == 0, not {n} x {k}"
    if not available():  # also what asks the kernel for AMX state: a tile op before it is SIGILL
        raise RuntimeError("AMX tiles are not available in this process")
    w = weight.detach().contiguous()
    out = torch.empty(n * k, dtype=torch.bfloat16)
    library().amx_bf16_pack(w.data_ptr(), n, k, out.data_ptr())
    return out


def linear(
    x: torch.Tensor,  # [M, K] bf16, unit inner stride
    tiles: torch.Tensor,  # pack(weight)
    bias: torch.Tensor | None,  # [N] bf16
    out_features: int,
) -> torch.Tensor:  # [M, N] bf16
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    assert x.dtype == torch.bfloat16 and tiles.numel() == out_features * k
    if bias is not None:
        assert (
            bias.dtype == torch.bfloat16 and bias.is_contiguous() and bias.numel() == out_features
        )
    out = torch.empty(m, out_features, dtype=torch.bfloat16)
    if m:
        library().amx_bf16_linear(
            x.data_ptr(), x.stride(0), tiles.data_ptr(),
            bias.data_ptr() if bias is not None else None, out.data_ptr(), out_features,
            m, out_features, k, torch.get_num_threads(),
        )  # fmt: skip
    return out
