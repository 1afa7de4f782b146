"""`model.quantization` -> what each layer keeps, decided before the model is built.

    none   float weights in the run dtype (a GGUF's blocks dequantized by `gguf.quants`)
    auto   what the checkpoint carries: a GGUF's quantized tensors stay in their block
           format (gguf_tensors.py); a float checkpoint stays float
    int8   float weights quantized at load: symmetric 8-bit per 32-weight block (q8)
    int4   float weights quantized at load: asymmetric 4-bit per group of
           `model.quantization_group` weights (q4); the embedding / LM head in q8
    fp8    CUDA only (sm 89+): e4m3 weights with per-channel scales (fp8.py)

A pre-quantized HF checkpoint (a `quantization_config`: compressed_tensors.py, awq_gptq.py)
loads its own format under `auto` (`source` set: its q4 / q8 blocks, or on a GPU with fp8
its e4m3 rows) and dequantized under `none`; int8 / int4 / fp8 would quantize it a second
time and are refused.

Every refusal is a `ConfigError` naming the key, raised at start, never in a request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ConfigError
from engine.worker.quant import awq_gptq, compressed_tensors
from engine.worker.quant.blocks import BLOCK, Q4, Q8
from engine.worker.quant.fp8 import check_fp8_device, fp8_capable
from engine.worker.quant.prequantized import Prequantized

METHODS = ("auto", "none", "int8", "int4", "fp8")


@dataclass(frozen=True)
class QuantPlan:
    """What the loader builds: `layers` / `head` are the block kinds float linears and the
    embedding + LM head are quantized to (None: kept as loaded); `blocks` says whether
    the layers take block tensors at all (False: the plain float model)."""

    method: str  # none gguf int8 int4 fp8, or a checkpoint's: compressed-tensors awq gptq
    blocks: bool
    layers: int | None = None
    head: int | None = None
    group: int = BLOCK
    # The CPU block kernels quantize activations to int8 at small batches (else fp32).
    int8_activations: bool = False
    # A pre-quantized checkpoint's reader (its modules' tensors -> the layers' formats).
    source: Prequantized | None = None

    def describe(self) -> str:
        acts = "; activations int8 per 32 values at small batches" if self.int8_activations else ""
        if self.source is not None:
            if not self.blocks:
                how = "dequantized to float"
            elif self.method == "fp8":
                how = "e4m3 rows kept as stored"
            elif self.source.fp8:
                how = "e4m3 rows dequantized to the run dtype at load"
            else:
                how = "integer weights as q4 / q8 blocks" + acts
            requested = "auto" if self.blocks else "none"
            return f"quantization {requested}: the checkpoint's {self.source.summary}, {how}"
        if not self.blocks:
            return f"quantization {self.method}: float weights"
        if self.method == "gguf":
            return "quantization auto: the GGUF's quantized tensors kept in block formats" + acts
        if self.method == "fp8":
            return "quantization fp8: linears e4m3 with per-channel scales, LM head as loaded"
        return f"quantization {self.method}: layers {_name(self.layers, self.group)}, " + (
            f"embedding/LM head {_name(self.head, BLOCK)}{acts}"
        )


def _name(kind: int | None, group: int) -> str:
    if kind == Q4:
        return f"int4 (q4, asymmetric, group {group})"
    if kind == Q8:
        return "int8 (q8, symmetric, group 32)"
    return "as loaded"


def resolve_plan(
    requested: str,
    *,
    gguf_quantized: bool,
    hf_config: Any,
    device: torch.device,
    group: int = BLOCK,
    activations: str = "float",
) -> QuantPlan:
    """The plan for `model.quantization` = `requested` on this checkpoint and device.

    `gguf_quantized`: the checkpoint is a GGUF with at least one quantized 2-D tensor.
    `activations` (`model.quant_activations`): int8 puts the CPU block kernels on int8
    activations (csrc/quant_linear_i8.c); float or auto keeps fp32 products."""
    plan = _resolve_plan(requested, gguf_quantized, hf_config, device, group)
    if plan.blocks and plan.method != "fp8" and activations == "int8":
        return dataclasses.replace(plan, int8_activations=True)
    return plan


def _resolve_plan(
    requested: str, gguf_quantized: bool, hf_config: Any, device: torch.device, group: int
) -> QuantPlan:
    if requested not in METHODS:
        raise ConfigError("model.quantization", f"must be one of {', '.join(METHODS)}")
    source = read_prequantized(hf_config)
    if source is not None:
        return _prequantized_plan(requested, source, device)
    if requested == "fp8":
        check_fp8_device(device, "model.quantization")
        return QuantPlan("fp8", blocks=True)
    if requested == "none" or (requested == "auto" and not gguf_quantized):
        return QuantPlan("none" if requested == "none" else "auto", blocks=False)
    if requested == "auto":
        return QuantPlan("gguf", blocks=True)
    if device.type != "cpu":
        raise ConfigError(
            "model.quantization",
            f"{requested} runs on the CPU kernels only; on {device.type} use fp8 or none",
        )
    if requested == "int4":
        _check_group(group, hf_config)
        return QuantPlan("int4", blocks=True, layers=Q4, head=Q8, group=group)
    _check_widths(hf_config, BLOCK, "model.quantization")
    return QuantPlan("int8", blocks=True, layers=Q8, head=Q8)


def read_prequantized(hf_config: Any) -> Prequantized | None:
    """The checkpoint's `quantization_config` read by its format's reader; None for float
    weights (a GGUF's converted config has none: the GGUF loader drops the one
    transformers writes). A method we have no reader for is refused at start, naming its
    method, bits and group size, instead of failing later on its tensor names or being
    read as float weights."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else getattr(qc, "to_dict", lambda: vars(qc))()
    method = qc.get("quant_method", "unknown")
    if method == "compressed-tensors":
        return compressed_tensors.read_config(qc)
    if method in ("awq", "gptq"):
        return awq_gptq.read_config(qc)
    detail = ", ".join(f"{k} {qc[k]}" for k in ("bits", "group_size", "desc_act") if k in qc)
    raise ConfigError(
        "model.path",
        f"the checkpoint is pre-quantized (quantization_config: quant_method {method}"
        + (f", {detail}" if detail else "")
        + "), a method not loaded here (docs/quantization.md); loaded are compressed-tensors "
        "(int4, int8, fp8: what llm-compressor writes), AutoAWQ gemm and AutoGPTQ int4 "
        "checkpoints. Else use the model's float or GGUF release, or a float checkpoint "
        "with model.quantization int8 / int4",
    )


def _prequantized_plan(requested: str, source: Prequantized, device: torch.device) -> QuantPlan:
    if requested == "none":
        return QuantPlan("none", blocks=False, source=source)
    if requested != "auto":
        raise ConfigError(
            "model.quantization",
            f"{requested} would quantize a checkpoint that is already quantized "
            f"({source.summary}); use auto (its own format) or none (dequantized)",
        )
    if source.fp8 and _runs_fp8(device):
        return QuantPlan("fp8", blocks=True, source=source)
    return QuantPlan(source.method, blocks=True, source=source)


def _runs_fp8(device: torch.device) -> bool:
    """fp8 rows kept as stored (Fp8Linear) here; elsewhere they are dequantized at load."""
    return device.type == "cuda" and fp8_capable(device)


def _check_group(group: int, hf_config: Any) -> None:
    if group <= 0 or group % BLOCK:
        raise ConfigError("model.quantization_group", f"must be a multiple of {BLOCK}")
    _check_widths(hf_config, group, "model.quantization_group")


def _check_widths(hf_config: Any, group: int, key: str) -> None:
    """Every linear's input width (hidden, intermediate, heads x head_dim) must divide."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    widths = {
        "hidden_size": hf_config.hidden_size,
        "intermediate_size": hf_config.intermediate_size,
        "num_attention_heads * head_dim": hf_config.num_attention_heads * head_dim,
    }
    for what, n in widths.items():
        if n % group:
            raise ConfigError(key, f"{what} {n} is not divisible by the group of {group}")
