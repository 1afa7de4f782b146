"""Tiny compressed-tensors checkpoints, written by the compressed-tensors package itself.

`make_compressed_checkpoint(src, out, scheme)` takes a tiny float checkpoint
(tiny_models.make_tiny_checkpoint), attaches a quantization config with
compressed-tensors' own `apply_quantization_config`, computes each weight's scales and zero
points with its own `calculate_qparams` (min/max per group, channel or tensor: what
llm-compressor's default min-max observer computes), compresses with its own
`ModelCompressor` and saves the model and its `quantization_config` as llm-compressor does.
No code of ours writes a byte of it.

`decompressed_reference(out)` is the reference the loader is checked against: transformers'
float32 model whose quantized weights are compressed-tensors' own decompression of the
saved tensors (its module matching, its compressor's `decompress`), never our code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

# name -> (weights args, input activation args or None, format forced or None)
SCHEMES: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    # W4A16 (llm-compressor's GPTQ / AWQ default): int4 symmetric, groups of 128
    "w4a16": (dict(num_bits=4, strategy="group", group_size=128), None),
    # W4A16_ASYM: int4 with zero points, groups of 128
    "w4a16_asym": (dict(num_bits=4, strategy="group", group_size=128, symmetric=False), None),
    "w4_g32": (dict(num_bits=4, strategy="group", group_size=32), None),
    "w4_channel_asym": (dict(num_bits=4, strategy="channel", symmetric=False), None),
    # W8A16: int8 symmetric in groups of 128, packed
    "w8a16": (dict(num_bits=8, strategy="group", group_size=128), None),
    # W8A8: int8 per channel, int8 per-token dynamic activations (int-quantized)
    "w8a8": (
        dict(num_bits=8, strategy="channel"),
        dict(num_bits=8, strategy="token", dynamic=True),
    ),
    # FP8_DYNAMIC: e4m3 per channel, fp8 per-token dynamic activations
    "fp8_dynamic": (
        dict(num_bits=8, type="float", strategy="channel"),
        dict(num_bits=8, type="float", strategy="token", dynamic=True),
    ),
    # FP8: e4m3 per tensor, a static per-tensor activation scale (stored, unused by us)
    "fp8": (
        dict(num_bits=8, type="float", strategy="tensor"),
        dict(num_bits=8, type="float", strategy="tensor"),
    ),
    # refused ones
    "w3a16": (dict(num_bits=3, strategy="group", group_size=128), None),
    "w4_g16": (dict(num_bits=4, strategy="group", group_size=16), None),
    "fp8_block": (dict(num_bits=8, type="float", strategy="block", block_structure=[64, 64]), None),
}


def _qparams(module: torch.nn.Module, args: Any, input_args: Any) -> None:
    """Scales and zero points from min / max, by compressed-tensors' calculate_qparams."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = module.weight.detach()
    if args.strategy == "group":
        g = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "block":
        rows, cols = args.block_structure
        g = w.reshape(w.shape[0] // rows, rows, w.shape[1] // cols, cols).transpose(1, 2)
        lo, hi = g.amin((-2, -1)), g.amax((-2, -1))
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    if input_args is not None and not input_args.dynamic and hasattr(module, "input_scale"):
        module.input_scale.data.fill_(0.05)  # a static activation scale (we never use it)


def make_compressed_checkpoint(
    src: str | Path,
    out: str | Path,
    scheme: str,
    *,
    fp16_scales: bool = True,
    ignore: tuple[str, ...] = ("lm_head",),
    max_shard_size: str | None = None,
) -> Path:
    """`src` (a tiny float checkpoint) compressed with `SCHEMES[scheme]` into `out`.

    `fp16_scales`: the scales are fp16 values (compressed-tensors' `scale_dtype`, what a
    fp16 / bf16 model's scales are), stored in the checkpoint's float32; False keeps fp32
    scales (our blocks then round them to fp16). `max_shard_size` (e.g. "5KB"): several
    safetensors shards, a module's tensors split across them."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM

    src, out = Path(src), Path(out)
    weights, inputs = SCHEMES[scheme]
    scale_dtype = torch.float16 if fp16_scales and weights.get("type") != "float" else None
    w_args = QuantizationArgs(**{"type": "int", **weights}, scale_dtype=scale_dtype)
    a_args = None if inputs is None else QuantizationArgs(**{"type": "int", **inputs})
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=w_args,
                                                     input_activations=a_args)},
        ignore=list(ignore),
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                _qparams(module, module.quantization_scheme.weights, a_args)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(
        str(out), **({"max_shard_size": max_shard_size} if max_shard_size else {})
    )
    compressor.update_config(str(out))
    for f in src.iterdir():  # tokenizer and generation config
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    return out


def edit_quantization_config(ckpt: Path, **changes: Any) -> None:
    """Rewrites keys of group_0's weights (or, with a `top_` prefix, of the config)."""
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    qc = config["quantization_config"]
    for key, value in changes.items():
        if key.startswith("top_"):
            qc[key.removeprefix("top_")] = value
        else:
            qc["config_groups"]["group_0"]["weights"][key] = value
    path.write_text(json.dumps(config))


def decompressed_reference(out: str | Path) -> Any:
    """transformers' float32 model of `out` with every quantized weight decompressed by
    compressed-tensors from the saved tensors (see the module docstring)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    config = AutoConfig.from_pretrained(str(out))
    qc_dict = json.loads((out / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(qc_dict)
    del config.quantization_config
    saved: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    # compressed-tensors' own matching of modules to schemes, on a throwaway model
    matcher = AutoModelForCausalLM.from_config(config)
    apply_quantization_config(matcher, qc, show_progress=False)
    state: dict[str, torch.Tensor] = {}
    for name, module in matcher.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        fmt = scheme.format or qc.format
        leaves = {n.removeprefix(name + "."): t for n, t in saved.items()
                  if n.rpartition(".")[0] == name}  # fmt: skip
        weight = BaseCompressor.get_value_from_registry(fmt).decompress(leaves, scheme)["weight"]
        state[f"{name}.weight"] = weight.float()
        if "bias" in leaves:
            state[f"{name}.bias"] = leaves["bias"].float()
        for leaf in leaves:
            saved.pop(f"{name}.{leaf}")
    state.update({n: t.float() for n, t in saved.items()})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(m == "lm_head.weight" for m in missing), missing  # tied: the embedding
    return model.float().eval()
