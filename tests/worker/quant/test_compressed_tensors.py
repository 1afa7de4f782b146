"""compressed-tensors checkpoints load as such: fidelity against compressed-tensors' own
decompression, run by transformers in float32 (tests/support/compressed_checkpoints.py
writes every fixture with the compressed-tensors package; our code writes none of it).

    weights    each quantized layer's dequantized weight vs compressed-tensors' decompressed
               one: bit for bit where the conversion is exact (symmetric int4 / int8 with
               fp16-valued scales, fp8), within the fp16 rounding of d / m elsewhere
    logprobs   teacher-forced log-probabilities vs transformers on the decompressed
               weights, the sequence in one step and in chunks of 3 (the block kernels);
               one group's scale x 1.5 lands >= 3x above the tolerance
    engine     greedy generation through `engine.LLM`, token for token with transformers

Tolerances are pinned at >= 2x the differences measured here (docs/quantization.md).
"""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.worker.kernels import quant as qkernels
from engine.worker.models.loader import load_model
from engine.worker.quant.blocks import dequantize
from engine.worker.quant.linear import QuantLinear
from tests.support.compressed_checkpoints import (
    decompressed_reference,
    make_compressed_checkpoint,
)
from tests.support.tiny_models import model_greedy
from tests.worker.quant.test_quant_fidelity import SEQ, logprobs, max_diff, perturb_one_group

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="no C compiler")

CPU = torch.device("cpu")
# Wide enough for groups of 128: every linear's input width is 128 or 256.
WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32)

# max |dlogprob| over positions and vocabulary, pinned >= 2x measured (2026-12-06, this box;
# measured values in the comments). Exact conversions differ by fp32 summation order only.
LOGPROB_TOL = {
    "w4a16": 6e-5,  # 3.0e-5
    "w4_g32": 6e-5,  # 2.4e-5
    "w8a16": 3e-5,  # 9.6e-6
    "w8a8": 3e-5,  # 1.3e-5
    "fp8_dynamic": 5e-5,  # 2.1e-5 (dequantized on the CPU)
    "fp8": 3e-5,  # 1.1e-5
    "w4a16_asym": 4e-2,  # 1.5e-2: m = -s * z rounded to fp16
    "w4_channel_asym": 4e-2,  # 1.8e-2
}
# fp32 scales (rounded to fp16 in our blocks): what that rounding costs
FP32_SCALES_TOL = {"w4a16": 2.5e-2, "w8a8": 2e-2}  # 1.05e-2, 7.7e-3
# max |w_ours - w_ct| / max |w| per layer where the conversion rounds (2^-11 of d or m)
WEIGHT_TOL = 2e-3  # measured 4.1e-4 (asymmetric), 8.2e-4 (asymmetric, fp32 scales)
EXACT = ("w4a16", "w4_g32", "w8a16", "w8a8", "fp8_dynamic", "fp8")


@pytest.fixture(scope="module")
def compressed(tiny_checkpoint, tmp_path_factory):
    """Factory: `compressed(scheme, arch="llama", fp16_scales=True)` -> checkpoint dir."""
    root = tmp_path_factory.mktemp("compressed")
    cache = {}

    def build(scheme: str, arch: str = "llama", fp16_scales: bool = True):
        key = (scheme, arch, fp16_scales)
        if key not in cache:
            src = tiny_checkpoint(arch, tie_word_embeddings=arch == "qwen3", **WIDE)
            out = root / f"{arch}-{scheme}-{'fp16' if fp16_scales else 'fp32'}"
            cache[key] = make_compressed_checkpoint(src, out, scheme, fp16_scales=fp16_scales)
        return cache[key]

    return build


def _load(path, **kw):
    kw.setdefault("quant_activations", "float")
    return load_model(ModelConfig(path=str(path), dtype="float32", **kw), CPU)


def _reference_logprobs(ckpt) -> torch.Tensor:
    with torch.no_grad():
        logits = decompressed_reference(ckpt)(torch.tensor([SEQ])).logits[0]
    return torch.log_softmax(logits.double(), -1)


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _weight_errors(loaded, ref) -> list[float]:
    """Per quantized layer: max |ours - compressed-tensors'| / max |compressed-tensors'|."""
    errors = []
    for name, layer in loaded.model.named_modules():
        if not isinstance(layer, QuantLinear) or ".layers." not in name:
            continue
        ours = dequantize(layer.blocks()) if layer.kind is not None else layer.dense.float()
        parent, _, leaf = name.rpartition(".")
        parts = _FUSED.get(leaf, (leaf,))
        theirs = torch.cat([ref.get_submodule(f"{parent}.{p}").weight.detach() for p in parts])
        errors.append(float((ours - theirs).abs().max() / theirs.abs().max()))
    return errors


@pytest.mark.parametrize("scheme", sorted(LOGPROB_TOL))
def test_weights_are_compressed_tensors_decompression_exactly_or_within_fp16(scheme, compressed):
    ckpt = compressed(scheme)
    errors = _weight_errors(_load(ckpt), decompressed_reference(ckpt))
    print(f"{scheme}: worst layer |w - w_ct| / max|w| {max(errors):.2e}")
    assert len(errors) == 2 * 4  # qkv, o, gate_up, down per layer
    assert max(errors) == 0.0 if scheme in EXACT else max(errors) <= WEIGHT_TOL


@pytest.mark.parametrize("scheme", sorted(FP32_SCALES_TOL))
def test_fp32_scales_round_to_fp16_within_a_stated_bound(scheme, compressed):
    ckpt = compressed(scheme, fp16_scales=False)
    errors = _weight_errors(_load(ckpt), decompressed_reference(ckpt))
    print(f"{scheme}, fp32 scales: worst layer |w - w_ct| / max|w| {max(errors):.2e}")
    assert 0.0 < max(errors) <= WEIGHT_TOL
    diff = max_diff(logprobs(_load(ckpt), chunk=3), _reference_logprobs(ckpt))
    print(f"{scheme}, fp32 scales: max |dlogprob| {diff:.2e}")
    assert diff <= FP32_SCALES_TOL[scheme]


def _perturb(model, path="model.layers.0.mlp.down_proj") -> None:
    """One group's scale x 1.5: the first block's d (q4 / q8), or the first 32 weights of
    the first row of a dense (fp8 dequantized) layer."""
    layer = model.get_submodule(path)
    if layer.kind is None:
        layer.dense[0, :32].mul_(1.5)
    else:
        perturb_one_group(model, path)


@pytest.mark.parametrize("scheme", sorted(LOGPROB_TOL))
def test_compressed_checkpoint_tracks_transformers_on_its_decompressed_weights(scheme, compressed):
    ckpt = compressed(scheme)
    ref = _reference_logprobs(ckpt)
    loaded = _load(ckpt)
    down = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) and (down.kind is None) == scheme.startswith("fp8")
    tol = LOGPROB_TOL[scheme]
    diffs = [max_diff(logprobs(loaded, chunk=c), ref) for c in (None, 3)]
    print(f"{scheme}: max |dlogprob| one step {diffs[0]:.2e}, chunks of 3 {diffs[1]:.2e}")
    assert max(diffs) <= tol
    _perturb(loaded.model)
    off = max_diff(logprobs(loaded, chunk=3), ref)
    print(f"{scheme}: one scale x1.5 -> {off:.2e}")
    assert off >= 3 * tol


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_biases_and_a_tied_embedding_load_beside_packed_weights(arch, compressed):
    """qwen2: q/k/v biases beside packed weights; qwen3: q/k norms, the tied embedding
    (left float by the checkpoint) as the LM head."""
    ckpt = compressed("w4a16", arch=arch)
    diff = max_diff(logprobs(_load(ckpt), chunk=3), _reference_logprobs(ckpt))
    print(f"{arch} w4a16: max |dlogprob| {diff:.2e}")
    assert diff <= LOGPROB_TOL["w4a16"]


def test_a_module_split_across_shards_loads_as_one(compressed, tiny_checkpoint, tmp_path):
    """Shards of 5 KB put a module's weight_packed, weight_scale and weight_shape in
    different files: it is converted once all of them have been read, the same blocks."""
    whole = compressed("w4a16")
    sharded = make_compressed_checkpoint(
        tiny_checkpoint("llama", **WIDE), tmp_path / "sharded", "w4a16", max_shard_size="5KB"
    )
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    leaves = {index[f"model.layers.0.mlp.down_proj.{leaf}"] for leaf in
              ("weight_packed", "weight_scale", "weight_shape")}  # fmt: skip
    assert len(leaves) > 1
    assert torch.equal(logprobs(_load(sharded)), logprobs(_load(whole)))


def test_quantization_none_dequantizes_to_the_same_float_weights(compressed):
    ckpt = compressed("w4a16")
    loaded = _load(ckpt, quantization="none")
    assert not isinstance(loaded.model.model.layers[0].mlp.down_proj, QuantLinear)
    diff = max_diff(logprobs(loaded), _reference_logprobs(ckpt))
    print(f"w4a16 under quantization none: max |dlogprob| {diff:.2e}")
    assert diff <= LOGPROB_TOL["w4a16"]


def test_greedy_generation_through_llm_matches_transformers_token_for_token(compressed):
    ckpt = compressed("w4a16")
    prompts = [[5, 77, 300, 12], [9, 401, 250, 3, 3, 64, 128], [17, 211]]
    llm = LLM(str(ckpt), dtype="float32", quant_activations="float", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = model_greedy(decompressed_reference(ckpt), prompts, 12, eos=set())
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_two_tensor_parallel_ranks_slice_the_converted_blocks(compressed):
    """Each rank reads the packed tensors whole, converts them, then takes its rows or its
    32-column blocks (o_proj / down_proj: 64 / 128 columns a rank, inside a 128 group)."""
    ckpt = compressed("w4a16_asym")
    prompts = [[5, 77, 300, 12], [9, 401, 250, 3, 3, 64, 128]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = dict(dtype="float32", device="cpu", quant_activations="float", num_kv_blocks=64)

    def ids(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    tp2 = LLM(str(ckpt), tensor_parallel_size=2, **engine)
    try:
        assert ids(tp2) == ids(LLM(str(ckpt), **engine))
    finally:
        tp2.close()
