"""Bad input is refused at start with a ConfigError naming the key (and the tensor/type),
never a crash in the first request; fp8's scale and layout logic runs on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, ConfigError, ModelConfig
from engine.worker.models import gguf_loader
from engine.worker.models.loader import load_model
from engine.worker.quant.blocks import dequantize
from engine.worker.quant.fp8 import (
    Fp8Linear,
    check_kv_dtype,
    dequantize_fp8_rows,
    quantize_fp8_activations,
    quantize_fp8_rows,
)
from engine.worker.quant.gguf_tensors import _converter
from tests.support.tiny_models import make_tiny_gguf

CPU = torch.device("cpu")


def test_unknown_quantization_names_the_key():
    with pytest.raises(ConfigError, match=r"^model\.quantization: must be one of"):
        ModelConfig(quantization="int3")
    with pytest.raises(ConfigError, match=r"^model\.quantization_group"):
        ModelConfig(quantization_group=48)
    with pytest.raises(ConfigError, match=r"^cache\.kv_dtype"):
        CacheConfig(kv_dtype="fp8_e5m2")


def test_fp8_weights_and_fp8_kv_are_refused_on_a_cpu(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"^model\.quantization: fp8 runs only on CUDA"):
        load_model(ModelConfig(path=str(tiny_llama_dir), quantization="fp8"), CPU)
    with pytest.raises(ConfigError, match=r"^cache\.kv_dtype: fp8 runs only on CUDA"):
        check_kv_dtype("fp8_e4m3", CPU)
    check_kv_dtype("auto", CPU)  # the default passes


def test_int4_group_that_does_not_divide_the_hidden_size_is_refused(tiny_llama_dir):
    # the tiny model's hidden size is 64
    cfg = ModelConfig(path=str(tiny_llama_dir), quantization="int4", quantization_group=128)
    with pytest.raises(ConfigError, match=r"^model\.quantization_group: hidden_size 64 is not"):
        load_model(cfg, CPU)


@pytest.mark.parametrize(
    ("qc", "named"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True},
         r"pre-quantized \(quantization_config: quant_method bitsandbytes\)"),
        ({"quant_method": "hqq", "bits": 4, "group_size": 64},
         r"pre-quantized \(quantization_config: quant_method hqq, bits 4, group_size 64\)"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
         r"gptq checkpoint: quantization_config\.desc_act is true"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
         r"no tensor in the checkpoint is quantized"),
    ],
)  # fmt: skip
def test_prequantized_hf_checkpoint_is_refused_at_start_naming_its_method(
    tiny_llama_dir, tmp_path, qc, named
):
    """A method without a reader here, a setting its reader refuses, or a config over float
    tensors: never read as float weights. (What loads:
    test_compressed_tensors*.py, test_awq_gptq.py.)"""
    import json
    import shutil

    ckpt = tmp_path / "prequantized"
    shutil.copytree(tiny_llama_dir, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = qc
    (ckpt / "config.json").write_text(json.dumps(config))
    for method in ("auto", "none"):  # int8 / int4 / fp8: test_compressed_tensors_config.py
        with pytest.raises(ConfigError, match=rf"^model\.path: .*{named}"):
            load_model(ModelConfig(path=str(ckpt), quantization=method), CPU)


def test_gguf_tensor_type_without_a_kernel_is_refused_naming_tensor_and_type(
    tiny_llama_dir, tmp_path, monkeypatch
):
    import gguf

    monkeypatch.setenv(gguf_loader.CACHE_ENV, str(tmp_path / "cache"))
    path = make_tiny_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    # Rewrite one tensor's type in the recorded index as Q2_K (a type we refuse).
    model_dir = gguf_loader.convert_gguf(path)
    index = gguf_loader.gguf_index(model_dir)
    entry = next(t for t in index["tensors"] if t["name"] == "blk.0.ffn_down.weight")
    entry["type"] = gguf.GGMLQuantizationType.Q2_K.name
    (model_dir / "gguf_tensors.json").write_text(__import__("json").dumps(index))
    with pytest.raises(ConfigError, match=r"^model\.path: .*'blk\.0\.ffn_down\.weight'.*Q2_K"):
        load_model(ModelConfig(path=str(path)), CPU)


@pytest.mark.parametrize(("qtype", "nbytes"), [("Q4_K", 144), ("Q6_K", 210), ("Q5_K", 176)])
def test_k_quants_map_within_a_stated_bound_of_gguf_dequantize(qtype, nbytes):
    """No gguf writer quantizes K-types, so the blocks are random bytes with sane scales."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    t = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (16, 2 * nbytes), dtype=np.uint8)
    blocks = raw.reshape(16, 2, nbytes)
    scale_at = 208 if qtype == "Q6_K" else 0
    blocks[..., scale_at : scale_at + 2] = np.array([0.001], np.float16).view(np.uint8)
    if qtype != "Q6_K":
        blocks[..., 2:4] = np.array([0.002], np.float16).view(np.uint8)
    ref = gguf_dequantize(raw, t).reshape(16, 512)
    ours = dequantize(_converter(t, 512)(raw)).numpy()
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    # Q4_K: fp16 rounding of each sub-block's scale; Q5_K / Q6_K: an 8-bit re-grid
    assert err <= (1e-3 if qtype == "Q4_K" else 5e-3)


def test_fp8_rows_round_trip_within_e4m3_precision():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    assert torch.allclose(scale, w.abs().amax(1) / 448)
    rel = (dequantize_fp8_rows(q, scale) - w).abs() / w.abs().amax(1, keepdim=True)
    assert float(rel.max()) <= 2**-4  # e4m3: 3 mantissa bits, half-ulp 1/16 of the top


def test_fp8_linear_holds_e4m3_rows_and_computes_with_them():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    layer = Fp8Linear(64, 32, False, target=None)
    layer.load_tensor("weight", None, w)
    assert layer.finalize().startswith("fp8")
    x = torch.randn(3, 64)
    expected = x @ dequantize_fp8_rows(*quantize_fp8_rows(w)).t()
    torch.testing.assert_close(layer(x), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_activations_take_the_bits_of_the_plain_formula(dtype):
    """Fewer kernels, the same bytes and scales as `x.float().abs().amax() / 448`, a clamp
    to +-448 and the cast: over rows of every magnitude, a zero row and exact row maxima."""
    gen = torch.Generator().manual_seed(2)
    mags = torch.logspace(
        -30 if dtype != torch.float16 else -6, 30 if dtype != torch.float16 else 4, 64
    )
    x = (torch.randn(64, 512, generator=gen) * mags[:, None]).to(dtype)
    x[3] = 0
    x[5, 7] = x[5].abs().max() * -1  # the row maximum negative
    xq, xs = quantize_fp8_activations(x)
    ref_s = (x.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    ref_q = (x.float() / ref_s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert xs.dtype == torch.float32 and xs.shape == (64, 1)
    assert torch.equal(xs, ref_s)
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8))
    assert not torch.isnan(xq.float()).any()
