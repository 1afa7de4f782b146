"""compressed-tensors checkpoints (what llm-compressor writes, for its GPTQ, AWQ and
round-to-nearest recipes alike) into the formats our layers keep.

    read_config(qc)       validate `quantization_config` at start (ConfigError on model.path
                          naming the key), return a `Prequantized` source
    convert(module, t)    one module's tensors -> q4 / q8 blocks or `Fp8Rows`

What loads, per module, read off the tensors themselves (so a mixed-precision checkpoint
needs no target matching; the config is only checked for what we cannot build):

    pack-quantized int4   codes u = q + 8 in nibbles -> q4 with d = scale and
                          m = -scale * (zero_point + 8) (symmetric: zero_point 0, m = -8 d)
    pack-quantized int8   codes u = q + 128 in bytes  -> q8 with d = scale
    int-/naive-quantized  int8 weights                -> q8 with d = scale
    float-quantized fp8   e4m3 weights, per-channel or per-tensor scale -> `Fp8Rows`

Groups (strategy group, sizes a multiple of 32), channels (one scale per row) and a tensor
scale all become one d (and m) per 32-weight block, repeated. The only rounding is fp16:
d and m are stored as fp16 in the blocks, so bf16 / fp16 scales give exact symmetric
weights, fp32 scales round (<= 2^-11 relative), and an asymmetric m = -s * z (a 4-bit
integer times s) rounds to <= 2^-11 of |m| (docs/quantization.md has the measurements).
Activation quantization in the config (W8A8's int8 per token, FP8's dynamic rows) is not
reproduced on the CPU: activations stay float, the more exact product of the same weights.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.config import ConfigError
from engine.worker.quant.blocks import BLOCK, BlockTensor, pack_q4, pack_q8
from engine.worker.quant.fp8_rows import Fp8Rows
from engine.worker.quant.prequantized import Prequantized, modules_marked

METHOD = "compressed-tensors"
WEIGHT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_MODEL_FORMATS = (*WEIGHT_FORMATS, "mixed-precision")
# A quantized module's tensors beside its bias; input_* (static activation scales) are
# read and dropped: activations stay float here.
_LEAVES = frozenset({"weight", "weight_packed", "weight_scale", "weight_zero_point",
                     "weight_shape", "weight_g_idx", "input_scale", "input_zero_point"})  # fmt: skip
FP16_MAX = 65504.0
SUPPORTED = (
    "loaded are int4 (pack-quantized, symmetric or with zero points, channel-wise or in "
    "groups of a multiple of 32), int8 (pack-, int- or naive-quantized, symmetric) and "
    "fp8 e4m3 (float-quantized, per channel or per tensor); see docs/quantization.md"
)


def read_config(qc: dict[str, Any]) -> Prequantized:
    """The checkpoint's `quantization_config` checked for what we build; a ConfigError on
    model.path naming the first key we do not."""

    def refuse(key: str, why: str) -> None:
        raise ConfigError(
            "model.path",
            f"compressed-tensors checkpoint: quantization_config.{key} {why}; {SUPPORTED}",
        )

    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        refuse("quantization_status", f"is {status!r} (only compressed weights are packed)")
    fmt = qc.get("format")
    if fmt not in _MODEL_FORMATS:
        refuse("format", f"is {fmt!r}, not a format we load")
    if _non_empty(qc.get("sparsity_config")):
        refuse("sparsity_config", "is set: sparse checkpoints are not loaded")
    if _non_empty(qc.get("transform_config")):
        refuse("transform_config", "is set: rotated (transformed) weights are not loaded")
    if qc.get("kv_cache_scheme") is not None:
        refuse(
            "kv_cache_scheme",
            "is set: its calibrated KV scales are not loaded (cache.kv_dtype: fp8_e4m3 "
            "stores K/V with scale 1)",
        )
    groups = qc.get("config_groups") or {}
    if not groups:
        refuse("config_groups", "is empty")
    kinds, fp8 = [], []
    for name, group in groups.items():
        key = f"config_groups.{name}"
        gfmt = group.get("format") or fmt
        if gfmt not in WEIGHT_FORMATS:
            refuse(f"{key}.format", f"is {gfmt!r}, not a format we load")
        weights = group.get("weights")
        if not weights:
            refuse(f"{key}.weights", "is null (activation-only quantization is not loaded)")
        why = _weights_problem(weights, gfmt)
        if why:
            refuse(f"{key}.weights.{why[0]}", why[1])
        for side in ("input_activations", "output_activations"):
            act = group.get(side)
            if act is None:
                continue
            if side == "output_activations":
                refuse(f"{key}.{side}", "is set: output quantization is not built")
            if act.get("num_bits", 8) < 8:
                refuse(f"{key}.{side}.num_bits", f"is {act.get('num_bits')}: below 8 bits")
        kinds.append(_describe(weights, gfmt))
        fp8.append(weights.get("type") == "float")
    return Prequantized(
        method=METHOD,
        summary=f"compressed-tensors {', '.join(sorted(set(kinds)))}",
        fp8=all(fp8),
        quantized_modules=quantized_modules,
        convert=convert,
    )


def _non_empty(value: Any) -> bool:
    return bool(value) and not (isinstance(value, dict) and value.get("format") == "dense")


def _weights_problem(w: dict[str, Any], fmt: str) -> tuple[str, str] | None:
    """(key under weights, why) when we cannot load this weight scheme, else None."""
    kind, bits = w.get("type", "int"), w.get("num_bits", 8)
    strategy = _strategy(w)
    if w.get("dynamic"):
        return "dynamic", "is set: weights quantized at run time are not loaded"
    if w.get("actorder") in ("group", "dynamic", True):
        return "actorder", (
            f"is {w.get('actorder')!r}: activation-ordered groups (g_idx, GPTQ desc_act) "
            "are not loaded (actorder weight / static keeps the layout and loads)"
        )
    if kind == "float":
        if bits != 8 or fmt not in ("float-quantized", "naive-quantized"):
            return "num_bits", f"is {bits} for float weights in {fmt}: only fp8 e4m3 loads"
        if strategy not in ("tensor", "channel"):
            return "strategy", f"is {strategy!r}: fp8 loads per channel or per tensor"
        return None
    if kind != "int":
        return "type", f"is {kind!r}"
    if bits not in (4, 8):
        return "num_bits", f"is {bits}: int4 (q4 blocks) and int8 (q8 blocks) load"
    if strategy not in ("tensor", "channel", "group"):
        return "strategy", f"is {strategy!r}: tensor, channel and group load"
    group = w.get("group_size")
    if strategy == "group" and (not group or group % BLOCK):
        return "group_size", f"is {group}: groups must be a multiple of {BLOCK} weights"
    if not w.get("symmetric", True) and (bits == 8 or fmt != "pack-quantized"):
        return "symmetric", f"is false for int{bits} in {fmt}: q8 blocks are symmetric"
    if bits == 4 and fmt != "pack-quantized":
        return "num_bits", f"is 4 in {fmt}: int4 loads from pack-quantized"
    return None


def _strategy(w: dict[str, Any]) -> str:
    if w.get("strategy"):
        return w["strategy"]
    group = w.get("group_size")
    return "tensor" if group is None else ("channel" if group == -1 else "group")


def _describe(w: dict[str, Any], fmt: str) -> str:
    if w.get("type") == "float":
        return f"fp8 e4m3 per {_strategy(w)} ({fmt})"
    strategy = _strategy(w)
    how = f"group {w.get('group_size')}" if strategy == "group" else f"per {strategy}"
    sym = "" if w.get("symmetric", True) else " asymmetric"
    return f"int{w.get('num_bits', 8)} {how}{sym} ({fmt})"


def quantized_modules(names: set[str]) -> dict[str, frozenset[str]]:
    """Module name -> the tensor leaves it carries, for every module with a `weight_scale`."""
    return modules_marked(names, "weight_scale", _LEAVES)


def convert(module: str, t: dict[str, torch.Tensor]) -> BlockTensor | Fp8Rows:
    """One module's tensors (by leaf name) as the layer keeps them."""

    def refuse(leaf: str, why: str):
        raise ConfigError("model.path", f"compressed-tensors tensor {module}.{leaf}: {why}")

    if "weight_g_idx" in t:
        refuse("weight_g_idx", "activation-ordered groups (actorder group) are not loaded")
    if "weight_packed" in t:
        return _packed(t, refuse)
    w = t.get("weight")
    if w is None:
        refuse("weight_packed", "missing (neither weight nor weight_packed is stored)")
    if "weight_zero_point" in t:
        refuse("weight_zero_point", f"present for {w.dtype} weights: q8 blocks are symmetric")
    if w.dtype == torch.int8:
        return pack_q8(w, _block_scales(t["weight_scale"], *w.shape, refuse)[0])
    if w.dtype == torch.float8_e4m3fn:
        s = t["weight_scale"].float()
        if s.numel() not in (1, w.shape[0]):
            refuse("weight_scale", f"has shape {tuple(s.shape)}: fp8 loads per channel or tensor")
        return Fp8Rows(w, s.reshape(-1).expand(w.shape[0]).contiguous())
    refuse("weight", f"has dtype {w.dtype}: int8 and float8_e4m3fn load")
    raise AssertionError  # unreachable: refuse raises


def _packed(t: dict[str, torch.Tensor], refuse) -> BlockTensor:
    if "weight_shape" not in t:
        refuse("weight_shape", "missing")
    rows, cols = (int(x) for x in t["weight_shape"].tolist())
    packed = t["weight_packed"]
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != rows:
        refuse("weight_packed", f"{packed.dtype} {tuple(packed.shape)} is not int32 [{rows}, ...]")
    if cols % BLOCK:
        refuse("weight_shape", f"{cols} input features are not a multiple of {BLOCK}")
    words = packed.shape[1]
    bits = words * 32 // cols
    if bits not in (4, 8) or bits * cols != words * 32:
        refuse("weight_packed", f"{words} int32 words per {cols} weights: only 4- and 8-bit load")
    raw = packed.contiguous().view(torch.uint8)  # little-endian words: element i at bit i*bits
    d, groups = _block_scales(t["weight_scale"], rows, cols, refuse)
    zp = t.get("weight_zero_point")
    if bits == 8:
        if zp is not None:
            refuse("weight_zero_point", "present for int8: q8 blocks are symmetric")
        return pack_q8((raw.to(torch.int16) - 128).to(torch.int8), d)
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).view(rows, cols)  # q + 8
    if zp is None:
        zero = torch.full_like(d, 8.0)
    else:
        zero = _zero_codes(zp, rows, groups, refuse).repeat_interleave(cols // groups // BLOCK, 1)
    return pack_q4(codes, d, -d * zero)


def _block_scales(scale: torch.Tensor, rows: int, cols: int, refuse) -> tuple[torch.Tensor, int]:
    """(d per 32-weight block [rows, cols / 32] fp32, number of scale groups per row)."""
    s = scale.float()
    if s.numel() == 1:
        s = s.reshape(1, 1).expand(rows, 1)
    if s.dim() != 2 or s.shape[0] != rows or cols % s.shape[1]:
        refuse("weight_scale", f"has shape {tuple(scale.shape)} for a [{rows}, {cols}] weight")
    groups = s.shape[1]
    width = cols // groups
    if width % BLOCK:
        refuse("weight_scale", f"groups of {width} weights: not a multiple of {BLOCK}")
    if not torch.isfinite(s).all() or float(s.abs().max()) > FP16_MAX:
        refuse("weight_scale", "holds values outside fp16's range")
    return s.repeat_interleave(width // BLOCK, 1).contiguous(), groups


def _zero_codes(zp: torch.Tensor, rows: int, groups: int, refuse) -> torch.Tensor:
    """Zero points packed along rows (int32 [ceil(rows / 8), groups], nibble i of a word is
    row 8w + i, stored + 8) -> fp32 [rows, groups] in 0..15, the code of the zero."""
    if zp.dtype != torch.int32 or tuple(zp.shape) != (math.ceil(rows / 8), groups):
        refuse(
            "weight_zero_point",
            f"{zp.dtype} {tuple(zp.shape)} is not int32 [{math.ceil(rows / 8)}, {groups}] "
            "(zero points packed along the rows)",
        )
    raw = zp.t().contiguous().view(torch.uint8)  # [groups, words * 4]
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).view(groups, -1)[:, :rows]
    return codes.t().float()
