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

Results differ from MKL's in the last bits (different blocking), so `runtime.cpu_kernels:
false` keeps plain `F.linear` for bit-level comparisons.
"""

from __future__ import annotations

import functools
import logging
import types

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# fp32 inputs with fewer rows than this use F.linear on the dense weight, on Intel CPUs
# (measured crossover: SmolLM2's layer GEMMs, 30 layers, 2 threads, Xeon: 1-3 rows F.linear
# faster, 4+ oneDNN faster); on other vendors MKL takes no fast path and oneDNN wins at once.
SMALL_ROWS_INTEL = 4
PACKED_DTYPES = (torch.float32, torch.bfloat16)


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
        packed = pack_weight(torch.zeros(8, 8, dtype=dtype))
        packed_linear(torch.zeros(1, 8, dtype=dtype), packed, None, 8)
    except RuntimeError as exc:
        logger.info("oneDNN cannot pack %s weights on this CPU (%s)", dtype, exc)
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN-reordered copy of a dense [out, in] fp32/bf16 weight, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [..., in] @ packed^T (+ bias) -> [..., out]."""
    if x.dim() != 2:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, x.shape[-1]), packed, bias, "none", [], ""
        )
        return y.view(*lead, out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


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
