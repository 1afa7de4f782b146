"""Tiny AutoAWQ (gemm) and AutoGPTQ-layout checkpoints, packed by the AutoAWQ package.

    make_awq_checkpoint(src, out, group, sym)   AutoAWQ's own `AwqQuantizer._apply_quant`
                                                (its min/max round-to-nearest, its
                                                `WQLinear_GEMM.from_linear` packing) on
                                                every decoder linear, the config from its
                                                `AwqConfig`. `sym`: the scales of its
                                                zero-point-free quantizer with every zero
                                                at 8 (AutoGPTQ's sym convention)
    make_gptq_checkpoint(awq_dir, out)          the same quantized values in AutoGPTQ's
                                                v1 layout by AutoAWQ's `unpack_reorder_pack`
                                                (its exllama conversion: rows packed 8 to a
                                                word, zeros stored - 1), trivial g_idx, the
                                                config from transformers' `GPTQConfig`
    awq_reference(awq_dir)                      transformers' float32 model on AutoAWQ's
                                                own `dequantize_gemm` of the saved tensors

AutoGPTQ itself installs but does not import under transformers 5, and GPTQModel needs
another torch (docs/quantization.md), so AutoAWQ is the independent packer of both
layouts; none of our code writes a byte of these checkpoints.
"""

from __future__ import annotations

import json
import shutil
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch


def _import_awq_quietly() -> None:
    """AutoAWQ announces its deprecation on its first import (resetting the filter for
    DeprecationWarning itself, so the warning is recorded here and dropped). It is installed
    without its dependencies (Makefile): `datasets`, which its calibration loader imports
    at the top of the package, gets a stand-in that refuses to load anything (the packing
    functions used here never call it) for the length of that import."""
    if "awq" in sys.modules:
        return
    stub = None
    try:
        import datasets  # noqa: F401
    except ImportError:
        stub = types.ModuleType("datasets")

        def load_dataset(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("AutoAWQ's calibration data is not available in tests")

        stub.load_dataset = load_dataset  # type: ignore[attr-defined]
        sys.modules["datasets"] = stub
    try:
        with warnings.catch_warnings(record=True):
            import awq  # noqa: F401
    finally:  # only AutoAWQ sees the stand-in: to every other library datasets is absent
        if stub is not None and sys.modules.get("datasets") is stub:
            del sys.modules["datasets"]


def _copy_side_files(src: Path, out: Path) -> None:
    for f in src.iterdir():  # tokenizer and generation config
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)


def _save(state: dict[str, torch.Tensor], src: Path, out: Path, qc: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    _copy_side_files(src, out)
    return out


def make_awq_checkpoint(src: str | Path, out: str | Path, group: int = 128, sym: bool = False):
    _import_awq_quietly()
    from awq.models._config import AwqConfig
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.module import get_named_linears, set_op_by_name
    from transformers import AutoModelForCausalLM

    src, out = Path(src), Path(out)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    quantizer = AwqQuantizer.__new__(AwqQuantizer)  # no calibration: the packing path only
    quantizer.w_bit, quantizer.group_size, quantizer.version = 4, group, "gemm"
    quantizer.zero_point = not sym
    with torch.no_grad():
        for layer in model.model.layers:
            named = get_named_linears(layer)
            if not sym:
                quantizer._apply_quant(layer, named)
                continue
            for name, linear in named.items():  # AutoGPTQ's sym: q - 8, zeros all 8
                linear = linear.half()
                _, scales, _ = quantizer.pseudo_quantize_tensor(linear.weight.data)
                zeros = torch.full_like(scales, 8)
                q = WQLinear_GEMM.from_linear(linear, 4, group, False,
                                              scales.t().contiguous(), zeros.t().contiguous())  # fmt: skip
                set_op_by_name(layer, name, q)
    qc = AwqConfig(zero_point=True, q_group_size=group, w_bit=4, version="gemm")
    return _save(model.state_dict(), src, out, qc.to_transformers_dict())


def make_gptq_checkpoint(awq_dir: str | Path, out: str | Path, sym: bool = False) -> Path:
    _import_awq_quietly()
    from awq.utils.packing_utils import unpack_reorder_pack
    from safetensors.torch import load_file
    from transformers import GPTQConfig

    awq_dir, out = Path(awq_dir), Path(out)
    awq_qc = json.loads((awq_dir / "config.json").read_text())["quantization_config"]
    group = awq_qc["group_size"]
    state = load_file(str(awq_dir / "model.safetensors"))
    for name in [n for n in state if n.endswith(".qweight")]:
        module = name.removesuffix(".qweight")
        qweight, qzeros = unpack_reorder_pack(state[name], state[f"{module}.qzeros"], 4)
        state[name], state[f"{module}.qzeros"] = qweight, qzeros
        k = qweight.shape[0] * 8
        state[f"{module}.g_idx"] = (torch.arange(k) // group).to(torch.int32)
    qc = GPTQConfig(bits=4, group_size=group, desc_act=False, sym=sym).to_dict()
    return _save(state, awq_dir, out, qc)


def awq_reference(awq_dir: str | Path) -> Any:
    """transformers' float32 model with each quantized linear's weight from AutoAWQ's own
    `dequantize_gemm` (given fp32 scales, so s * (q - z) is computed exactly)."""
    _import_awq_quietly()
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    awq_dir = Path(awq_dir)
    config = AutoConfig.from_pretrained(str(awq_dir))
    group = config.quantization_config["group_size"]
    del config.quantization_config
    saved = load_file(str(awq_dir / "model.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in saved.items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("qzeros", "scales"):
            continue
        if leaf == "qweight":
            w = dequantize_gemm(tensor, saved[f"{module}.qzeros"],
                                saved[f"{module}.scales"].float(), 4, group)  # fmt: skip
            state[f"{module}.weight"] = w.t().float()
        else:
            state[name] = tensor.float()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(m == "lm_head.weight" for m in missing), missing  # tied: the embedding
    return model.float().eval()
