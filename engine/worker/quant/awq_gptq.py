"""AutoAWQ (GEMM) and AutoGPTQ (v1) int4 checkpoints into q4 blocks.

    read_config(qc)       validate `quantization_config` (quant_method awq / gptq) at start;
                          a ConfigError on model.path naming the first key we do not load
    convert(module, t)    one module's qweight / qzeros / scales (/ g_idx) -> q4 blocks

Both store w[n, k] = s[g, n] * (q[k, n] - z[g, n]) with g = k // group_size, 4-bit q and z
packed 8 to an int32, fp16 scales [groups, N]; they differ in where the nibbles go:

    awq gemm    qweight [K, N / 8]: word c of row k holds columns 8c + (0 2 4 6 1 3 5 7)
                in nibbles 0..7; qzeros [groups, N / 8] the same way
    gptq (v1)   qweight [K / 8, N]: word r of column n holds rows 8r .. 8r + 7 in nibbles
                0..7; qzeros [groups, N / 8] as columns 8c .. 8c + 7, each stored as z - 1
                (read back as (nibble + 1) & 15, as AutoGPTQ does); g_idx [K] must be
                k // group_size (desc_act false: no reordering)

As q4 blocks: q as is, d = s, m = -s * z; the fp16 scales are exact in d, m = -s * z
rounds to fp16 (<= 2^-11 of |m|; with sym GPTQ, z = 8 and m = -8 s is exact).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.config import ConfigError
from engine.worker.quant.blocks import BLOCK, BlockTensor, pack_q4
from engine.worker.quant.prequantized import Prequantized, modules_marked

_LEAVES = frozenset({"qweight", "qzeros", "scales", "g_idx"})
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_AWQ_UNDO_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # nibble holding column j of a word
SUPPORTED = (
    "loaded are AutoAWQ gemm and AutoGPTQ (checkpoint_format gptq) int4 with groups of a "
    "multiple of 32 (or -1) and desc_act false; see docs/quantization.md"
)


def read_config(qc: dict[str, Any]) -> Prequantized:
    method = qc.get("quant_method")

    def refuse(key: str, why: str) -> None:
        raise ConfigError(
            "model.path", f"{method} checkpoint: quantization_config.{key} {why}; {SUPPORTED}"
        )

    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        refuse("bits", f"is {bits}: only 4-bit loads (q4 blocks)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group is None or (group != -1 and (group <= 0 or group % BLOCK)):
        refuse("group_size", f"is {group}: groups must be -1 or a multiple of {BLOCK}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            refuse("version", f"is {version!r}: only the gemm layout loads")
        if not qc.get("zero_point", True):
            refuse("zero_point", "is false: AutoAWQ's gemm layout is written with zero points")
        convert = _convert_awq
    else:
        if qc.get("desc_act"):
            refuse("desc_act", "is true: activation-ordered groups (g_idx) are not loaded")
        fmt = qc.get("checkpoint_format") or "gptq"
        if fmt != "gptq":
            refuse("checkpoint_format", f"is {fmt!r}: only gptq (v1) loads")
        convert = _convert_gptq
    sym = "" if method == "awq" or not qc.get("sym", True) else " symmetric"
    how = "per channel" if group == -1 else f"group {group}"
    return Prequantized(
        method=method,
        summary=f"{method} int4 {how}{sym}",
        fp8=False,
        quantized_modules=quantized_modules,
        convert=convert,
    )


def quantized_modules(names: set[str]) -> dict[str, frozenset[str]]:
    """Module name -> the tensor leaves it carries, for every module with a `qweight`."""
    return modules_marked(names, "qweight", _LEAVES)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i of each word."""
    return ((words.to(torch.int32)[..., None] >> _SHIFTS) & 0x0F).to(torch.uint8)


def _refuser(module: str, method: str):
    def refuse(leaf: str, why: str):
        raise ConfigError("model.path", f"{method} tensor {module}.{leaf}: {why}")

    return refuse


def _convert_awq(module: str, t: dict[str, torch.Tensor]) -> BlockTensor:
    refuse = _refuser(module, "awq")
    _need(t, ("qweight", "qzeros", "scales"), refuse)
    k, words = t["qweight"].shape
    q = _nibbles(t["qweight"])[..., _AWQ_UNDO_ORDER].reshape(k, words * 8)  # [K, N]
    z = _nibbles(t["qzeros"])[..., _AWQ_UNDO_ORDER].reshape(t["qzeros"].shape[0], -1)
    return _blocks(q, z, t["scales"], refuse)


def _convert_gptq(module: str, t: dict[str, torch.Tensor]) -> BlockTensor:
    refuse = _refuser(module, "gptq")
    _need(t, ("qweight", "qzeros", "scales"), refuse)
    rows, n = t["qweight"].shape
    q = _nibbles(t["qweight"]).transpose(1, 2).reshape(rows * 8, n)  # [K, N]
    z = (_nibbles(t["qzeros"]).reshape(t["qzeros"].shape[0], -1) + 1) & 0x0F
    g_idx = t.get("g_idx")
    if g_idx is not None:
        group = rows * 8 // t["scales"].shape[0]
        if not torch.equal(g_idx.long(), torch.arange(rows * 8) // group):
            refuse("g_idx", "is not k // group_size: activation-ordered groups are not loaded")
    return _blocks(q, z, t["scales"], refuse)


def _need(t: dict[str, torch.Tensor], leaves: tuple[str, ...], refuse) -> None:
    for leaf in leaves:
        if leaf not in t:
            refuse(leaf, "missing")
        if leaf != "scales" and t[leaf].dtype != torch.int32:
            refuse(leaf, f"has dtype {t[leaf].dtype}, not int32")


def _blocks(q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, refuse) -> BlockTensor:
    """q [K, N] and zero codes z [groups, N] (0..15), scales [groups, N] -> q4 [N, K]."""
    k, n = q.shape
    groups = scales.shape[0]
    if scales.dim() != 2 or scales.shape[1] != n or k % groups or tuple(z.shape) != (groups, n):
        refuse("scales", f"{tuple(scales.shape)} does not fit qweight's [{k}, {n}] / qzeros")
    width = k // groups
    if k % BLOCK or width % BLOCK:
        refuse("scales", f"groups of {width} of {k} input features: not multiples of {BLOCK}")
    s = scales.float()
    if not torch.isfinite(s).all():
        refuse("scales", "holds non-finite values")
    d = s.t().repeat_interleave(width // BLOCK, 1)  # [N, K / 32]
    zero = z.t().float().repeat_interleave(width // BLOCK, 1)
    return pack_q4(q.t().contiguous(), d, -d * zero)
