"""fp32 and bf16 linear layers on the CPU through oneDNN with weights packed once at load.

`F.linear` hands every call to MKL's sgemm, which re-packs the weight into its blocked
layout on every call; at decode batch sizes (tens of rows) that repacking is a large part of
each matmul. oneDNN can take a weight reordered once (`mkldnn._reorder_linear_weight`) and
reuse it for any number of rows: measured here at batch 64 the q/k/v, gate/up and LM-head
GEMMs ran 1.2-1.9x faster, and from 4 rows up oneDNN wins. Below that (a single user's
decode) MKL's GEMV on the dense weight is ~25% faster on an Intel Xeon, so the dense weight
is kept next to the packed copy and `small_rows` picks: linear weights take twice their
memory. MKL's fast paths dispatch on Intel CPUs only: on an AMD EPYC (2 threads, AVX-512)
oneDNN wins at every row count, one row included (SmolLM2's shapes, 1 / 2 / 4 rows: the
layers 1.3-2.0x / 2.4-4.0x / 2.8-4.0x, the LM head 1.8x / 3.9x / 4.6x), so there fp32
takes the packed weight from one row on too.

bf16 weights go the same way (oneDNN's brgemm with AVX-512-BF16 or AMX, bf16 in and out,
fp32 accumulation). There the packed path wins at every row count (measured on the model's
shapes, 2 threads, AVX-512-BF16: 1 row 1.8-2.2x, 4 rows 1.3-16x, 64 rows 1.1-2.2x over
`F.linear`, which re-packs per call), so bf16 inputs always take it.

On a CPU with AMX, bf16 weights whose shapes fit the tiles are packed for our own AMX
kernel instead (kernels/amx_linear.py, csrc/amx_linear.c) and steps of up to
`AMX_MAX_ROWS` rows take it; larger steps (prefill chunks) take F.linear on the dense
weight, which the layer keeps anyway, so memory is what the oneDNN copy took. Measured on a
2-core Xeon with AMX (6/207/2), llama50m's shapes (qkv, o, gate/up, down), weights in
cache, median us, kernel / oneDNN packed / F.linear: 1 row 12-33 / 29-49 / 44-110, 64 rows
24-149 / 41-167 / 59-248, 512 rows 139-911 / 238-778 / 266-865; at 2,048 rows the kernel
lost (583-4,176 / 486-2,880 / 487-2,764: once the GEMM is compute bound oneDNN's blocking
wins, and F.linear's repacking is paid off). A decode step's 32 layer GEMMs at 64 rows with
their weights coming from memory: 3.6 ms against oneDNN's 4.4 ms (`python bench/amx_linear.py`,
bench/results/amx_linear.jsonl). `APPLIANCE_AMX_LINEAR=off` keeps oneDNN.

Results differ from MKL's in the last bits (different blocking), so `runtime.cpu_kernels:
false` keeps plain `F.linear` for bit-level comparisons.
"""

from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.kernels import amx_linear

logger = logging.getLogger(__name__)

# fp32 inputs with fewer rows than this use F.linear on the dense weight, on Intel CPUs
# (measured crossover: SmolLM2's layer GEMMs, 30 layers, 2 threads, Xeon: 1-3 rows F.linear
# faster, 4+ oneDNN faster); on other vendors MKL takes no fast path and oneDNN wins at once.
SMALL_ROWS_INTEL = 4
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# bf16 steps of at most this many rows take the AMX kernel; larger ones F.linear (see above).
AMX_MAX_ROWS = 512


@dataclass(frozen=True)
class AmxWeight:
    """A bf16 weight in the AMX kernel's tile layout, with the dense weight it came from
    (the layer's own tensor, not a copy) for steps above AMX_MAX_ROWS; None: the kernel
    takes every row count."""

    tiles: torch.Tensor
    dense: torch.Tensor | None
    out_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.tiles.dtype


def small_rows(dtype: torch.dtype) -> int:
    """Below this many rows F.linear beats the packed weight (bf16: never, see above)."""
    return _fp32_small_rows() if dtype == torch.float32 else 1


@functools.cache
def _fp32_small_rows() -> int:
    from engine.worker.cpu_features import detect_cpu_features

    return fp32_small_rows_for(detect_cpu_features().vendor)


def fp32_small_rows_for(vendor: str) -> int:
    """The fp32 crossover for a CPU vendor (cpuinfo's vendor_id; "" when unknown: Intel's,
    the rule measured first)."""
    return SMALL_ROWS_INTEL if vendor in ("GenuineIntel", "") else 1


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can pack `dtype` weights here.

    bf16 packing needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: on an AVX2-only CPU (e.g. a
    Zen 3 EPYC) `_reorder_linear_weight` raises for bf16, so this probes it once per dtype."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    return _can_pack(dtype)


@functools.cache
def _can_pack(dtype: torch.dtype) -> bool:
    try:
        packed = pack_weight(torch.zeros(8, 8, dtype=dtype), amx=False)
        packed_linear(torch.zeros(1, 8, dtype=dtype), packed, None, 8)
    except RuntimeError as exc:
        logger.info("oneDNN cannot pack %s weights on this CPU (%s)", dtype, exc)
        return False
    return True


def pack_weight(weight: torch.Tensor, amx: bool = True) -> torch.Tensor | AmxWeight:
    """A packed copy of a dense [out, in] fp32/bf16 weight, for `packed_linear`: the AMX
    kernel's tiles for a bf16 weight where `amx` and the CPU allow (keeping `weight` for large
    steps), oneDNN's reordered weight otherwise."""
    n, k = weight.shape
    if (
        amx and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
        and amx_linear.supports(n, k) and amx_linear.available()
    ):  # fmt: skip
        return AmxWeight(amx_linear.pack(weight), weight.detach(), n)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor | AmxWeight, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [..., in] @ packed^T (+ bias) -> [..., out]."""
    if isinstance(packed, AmxWeight):
        return _amx_linear(x, packed, bias)
    if x.dim() != 2:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, x.shape[-1]), packed, bias, "none", [], ""
        )
        return y.view(*lead, out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _amx_linear(x: torch.Tensor, w: AmxWeight, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows > AMX_MAX_ROWS and w.dense is not None:
        return F.linear(x, w.dense, bias)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    y = amx_linear.linear(x2, w.tiles, bias, w.out_features)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], w.out_features)


def amx_summary(packed: list) -> str:
    """ " (N on AMX tiles up to AMX_MAX_ROWS rows)" for the start-up line, "" when none are:
    which format each packed weight took is this module's business, not the model's."""
    n = sum(isinstance(w, AmxWeight) for w in packed)
    return f" ({n} on AMX tiles up to {AMX_MAX_ROWS} rows)" if n else ""


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.numel() < small_rows(x.dtype) * x.shape[-1] or x.dtype != self.weight.dtype:
        return F.linear(x, self.weight, self.bias)  # also the empty input
    return packed_linear(x.contiguous(), self.packed_weight, self.bias, self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Switch every fp32/bf16 CPU `nn.Linear` in `model` to a packed weight; returns how many.

    Call after the weights are loaded and before anything captures the modules."""
    if not packing_available():
        logger.info("oneDNN unavailable; linears stay on F.linear")
        return 0
    count = 0
    packable = {dtype: packing_available(dtype) for dtype in PACKED_DTYPES}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or w is None:
            continue
        if w.device.type != "cpu" or not packable.get(w.dtype) or w.dim() != 2 or not w.numel():
            continue
        with torch.no_grad():
            module.packed_weight = pack_weight(w)
            bias = module.bias
            if bias is not None:
                module.bias = nn.Parameter(bias.detach().contiguous(), requires_grad=False)
        module.forward = types.MethodType(_packed_forward, module)
        count += 1
    return count
