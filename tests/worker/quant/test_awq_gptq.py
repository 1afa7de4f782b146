"""AutoAWQ (gemm) and AutoGPTQ (v1) int4 checkpoints load as q4 blocks: fidelity against
AutoAWQ's own dequantization run by transformers in float32. The fixtures are packed by
the AutoAWQ package (tests/support/awq_checkpoints.py: the GPTQ layout by its exllama
conversion), never by our code.

    weights    each layer's dequantized blocks vs AutoAWQ's `dequantize_gemm`: bit for bit
               with zeros at 8 (GPTQ's sym), within m's fp16 rounding with other zeros
    logprobs   teacher-forced, one step and chunks of 3; one scale x1.5 >= 3x tolerance
    refusals   desc_act, bits, version, a non-trivial g_idx: ConfigError naming key / tensor
"""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError, ModelConfig
from engine.worker.kernels import quant as qkernels
from engine.worker.models.loader import load_model
from engine.worker.quant.blocks import dequantize
from engine.worker.quant.linear import QuantLinear
from tests.support.awq_checkpoints import (
    awq_reference,
    make_awq_checkpoint,
    make_gptq_checkpoint,
)
from tests.support.tiny_models import model_greedy
from tests.worker.quant.test_quant_fidelity import SEQ, logprobs, max_diff, perturb_one_group

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="no C compiler")

CPU = torch.device("cpu")
WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32)
# (layout, group, zeros at 8) -> max |dlogprob| pinned >= 2x measured (2026-12-06, this
# box; measured in the comments); zeros elsewhere than 8 round m = -s * z to fp16
CASES = {
    ("awq", 128, False): 4e-2,  # 1.7e-2
    ("awq", 32, False): 4e-2,  # 1.6e-2
    ("gptq", 128, False): 4e-2,  # 1.7e-2 (the same values as awq: the same blocks)
    ("gptq", 128, True): 6e-5,  # 2.3e-5
    ("gptq", 32, True): 6e-5,  # 2.0e-5
}
WEIGHT_TOL = 2e-3  # max |w - w_awq| / max |w| with rounded m (measured in the test output)
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def packed(tiny_checkpoint, tmp_path_factory):
    """Factory: `packed(layout, group, sym)` -> (checkpoint dir, the AWQ dir it came from)."""
    root = tmp_path_factory.mktemp("awq_gptq")
    cache = {}

    def build(layout: str, group: int, sym: bool):
        key = (layout, group, sym)
        if key not in cache:
            src = tiny_checkpoint("llama", **WIDE)
            awq = root / f"awq-{group}-{sym}"
            if not awq.exists():
                make_awq_checkpoint(src, awq, group, sym=sym)
            ckpt = awq if layout == "awq" else root / f"gptq-{group}-{sym}"
            if layout == "gptq" and not ckpt.exists():
                make_gptq_checkpoint(awq, ckpt, sym=sym)
            cache[key] = (ckpt, awq)
        return cache[key]

    return build


def _load(path, **kw):
    return load_model(
        ModelConfig(path=str(path), dtype="float32", quant_activations="float", **kw), CPU
    )


def _reference_logprobs(awq_dir) -> torch.Tensor:
    with torch.no_grad():
        logits = awq_reference(awq_dir)(torch.tensor([SEQ])).logits[0]
    return torch.log_softmax(logits.double(), -1)


@pytest.mark.parametrize(("layout", "group", "sym"), sorted(CASES))
def test_blocks_are_awqs_dequantization_exactly_or_within_fp16(layout, group, sym, packed):
    ckpt, awq = packed(layout, group, sym)
    loaded, ref = _load(ckpt), awq_reference(awq)
    worst = 0.0
    for name, layer in loaded.model.named_modules():
        if not isinstance(layer, QuantLinear) or ".layers." not in name:
            continue
        assert layer.kind is not None
        parent, _, leaf = name.rpartition(".")
        parts = _FUSED.get(leaf, (leaf,))
        theirs = torch.cat([ref.get_submodule(f"{parent}.{p}").weight.detach() for p in parts])
        worst = max(worst, float((dequantize(layer.blocks()) - theirs).abs().max()
                                 / theirs.abs().max()))  # fmt: skip
    print(f"{layout} g{group} sym {sym}: worst layer |w - w_awq| / max|w| {worst:.2e}")
    assert worst == 0.0 if sym else 0.0 < worst <= WEIGHT_TOL


@pytest.mark.parametrize(("layout", "group", "sym"), sorted(CASES))
def test_awq_and_gptq_checkpoints_track_transformers_on_awqs_dequantization(
    layout, group, sym, packed
):
    ckpt, awq = packed(layout, group, sym)
    ref, loaded = _reference_logprobs(awq), _load(ckpt)
    tol = CASES[(layout, group, sym)]
    diffs = [max_diff(logprobs(loaded, chunk=c), ref) for c in (None, 3)]
    print(f"{layout} g{group} sym {sym}: max |dlogprob| {diffs[0]:.2e}, chunks {diffs[1]:.2e}")
    assert max(diffs) <= tol
    perturb_one_group(loaded.model)
    off = max_diff(logprobs(loaded, chunk=3), ref)
    print(f"{layout} g{group} sym {sym}: one scale x1.5 -> {off:.2e}")
    assert off >= 3 * tol


def test_gptq_greedy_generation_through_llm_matches_transformers(packed):
    ckpt, awq = packed("gptq", 128, True)
    prompts = [[5, 77, 300, 12], [9, 401, 250, 3, 3, 64, 128]]
    llm = LLM(str(ckpt), dtype="float32", quant_activations="float", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = model_greedy(awq_reference(awq), prompts, 12, eos=set())
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def _edit(ckpt, tmp_path, **changes):
    import shutil

    out = tmp_path / ckpt.name
    shutil.copytree(ckpt, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"].update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("layout", "changes", "named"),
    [
        ("gptq", {"desc_act": True}, r"gptq checkpoint: quantization_config\.desc_act is true"),
        ("gptq", {"bits": 8}, r"gptq checkpoint: quantization_config\.bits is 8"),
        ("gptq", {"group_size": 48}, r"gptq checkpoint: quantization_config\.group_size is 48"),
        ("gptq", {"checkpoint_format": "gptq_v2"}, r"gptq .*checkpoint_format is .gptq_v2."),
        ("awq", {"version": "gemv"}, r"awq checkpoint: quantization_config\.version is 'gemv'"),
    ],
)
def test_unsupported_settings_are_refused_at_start_naming_the_key(
    layout, changes, named, packed, tmp_path
):
    ckpt, _ = packed(layout, 128, False)
    with pytest.raises(ConfigError, match=rf"^model\.path: {named}"):
        _load(_edit(ckpt, tmp_path, **changes))


def test_an_activation_ordered_g_idx_is_refused_naming_the_tensor(packed, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = _edit(packed("gptq", 128, True)[0], tmp_path)
    state = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()  # groups no longer k // group_size
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"^model\.path: gptq tensor {name}: is not k //"):
        _load(ckpt)
