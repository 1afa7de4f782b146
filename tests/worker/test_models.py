"""Our model code vs transformers on tiny random checkpoints, through the paged torch backend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from engine.worker.attention.torch_paged import TorchPagedBackend
from engine.worker.models.llama import layer_sliding_windows
from engine.worker.models.registry import SUPPORTED_ARCHITECTURES, get_model_class
from engine.worker.models.rope import compute_inv_freq, rope_parameters
from tests.support.paged_harness import PagedRun

ATOL = 1e-4

CASES = {
    "llama": ("llama", {}),
    "llama-tied-llama3-rope": ("llama", {"tie_word_embeddings": True, "rope_scaling": "llama3"}),
    "llama-linear-rope": ("llama", {"rope_scaling": "linear"}),
    "mistral-sliding": ("mistral", {"sliding_window": 5}),
    "qwen2-sliding": ("qwen2", {"sliding_window": 5}),
    "qwen3": ("qwen3", {}),
    "qwen3-sliding-headdim32-bias": (
        "qwen3",
        {"sliding_window": 6, "head_dim": 32, "attention_bias": True},
    ),
}


def _load_ours(model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    model = get_model_class(config.architectures)(config)
    model.load_weights(load_file(str(model_dir / "model.safetensors")).items())
    return model.eval()


def _hf_logits(model_dir, prompts):
    from tests.support.tiny_models import _hf_model

    model = _hf_model(str(model_dir.resolve()))
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_batched_and_chunked(case, tiny_checkpoint):
    arch, overrides = CASES[case]
    model_dir = tiny_checkpoint(arch, **overrides)
    model = _load_ours(model_dir)
    prompts = _prompts([23, 7, 1, 16])
    refs = _hf_logits(model_dir, prompts)

    # One forward holding four requests of different lengths.
    run = PagedRun(model, TorchPagedBackend())
    out = run.step(dict(enumerate(prompts)))
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[i], ref, atol=ATOL, rtol=0)

    # The longest prompt in three chunks, KV of earlier chunks in the cache, with another
    # request prefilled alongside the middle chunk.
    run = PagedRun(model, TorchPagedBackend(), seed=1)
    long = prompts[0]
    first = run.step({"a": long[:5]})["a"]
    middle = run.step({"b": prompts[1], "a": long[5:14]})
    last = run.step({"a": long[14:]})["a"]
    chunked = torch.cat([first, middle["a"], last])
    torch.testing.assert_close(chunked, refs[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(middle["b"], refs[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["llama", "qwen2-sliding"])
def test_greedy_decode_matches_transformers(case, tiny_checkpoint, hf_greedy):
    arch, overrides = CASES[case]
    model_dir = tiny_checkpoint(arch, **overrides)
    model = _load_ours(model_dir)
    prompts = _prompts([9, 3, 14], seed=2)
    expected = hf_greedy(model_dir, prompts, max_new_tokens=12, ignore_eos=True)

    run = PagedRun(model, TorchPagedBackend())
    logits = run.step(dict(enumerate(prompts)))
    generated: list[list[int]] = [[] for _ in prompts]
    for _ in range(12):
        nxt = {i: int(lg[-1].argmax()) for i, lg in logits.items()}
        for i, t in nxt.items():
            generated[i].append(t)
        logits = run.step({i: [t] for i, t in nxt.items()})  # decode-only steps
    assert generated == expected
    assert len(set(generated[0])) > 3  # the tiny model does not collapse to one token


def test_sliding_windows_per_layer_follow_config(tiny_checkpoint):
    from transformers import AutoConfig

    mistral = AutoConfig.from_pretrained(tiny_checkpoint("mistral", sliding_window=5))
    qwen2 = AutoConfig.from_pretrained(tiny_checkpoint("qwen2", sliding_window=5))
    assert layer_sliding_windows(mistral) == [5, 5]
    assert layer_sliding_windows(qwen2) == [None, 5]  # layers >= max_window_layers slide
    # Older configs without layer_types.
    legacy = SimpleNamespace(
        num_hidden_layers=3, sliding_window=4, use_sliding_window=True, max_window_layers=2
    )
    assert layer_sliding_windows(legacy) == [None, None, 4]
    legacy.use_sliding_window = False
    assert layer_sliding_windows(legacy) == [None, None, None]
    model = get_model_class(qwen2.architectures)(qwen2)
    assert [s.sliding_window for s in model.attention_specs] == [None, 5]


def test_rope_parameters_read_both_config_styles():
    new_style = SimpleNamespace(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    )
    old_style = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5e5)
    no_scaling = SimpleNamespace(rope_scaling=None, rope_theta=1e4)
    assert rope_parameters(new_style) == rope_parameters(old_style)
    assert rope_parameters(old_style)["rope_type"] == "linear"
    assert rope_parameters(no_scaling) == {"rope_type": "default", "rope_theta": 1e4}
    default = compute_inv_freq(rope_parameters(no_scaling), 16, 512)
    llama3 = compute_inv_freq(
        {
            "rope_type": "llama3",
            "rope_theta": 1e4,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        16,
        512,
    )
    assert not torch.equal(default, llama3)  # the scaling really changes the frequencies
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        compute_inv_freq({"rope_type": "yarn", "rope_theta": 1e4}, 16, 512)


def test_unsupported_architecture_names_supported_ones():
    with pytest.raises(ValueError) as err:
        get_model_class(["GPT2LMHeadModel"])
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
    assert "GPT2LMHeadModel" in str(err.value)


def test_load_weights_rejects_missing_and_unknown_tensors(tiny_llama_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    model = get_model_class(config.architectures)(config)
    partial = {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match="missing 1 tensors: model.layers.1.self_attn.qkv_proj"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match="unexpected checkpoint tensor 'model.extra.weight'"):
        model.load_weights([*weights.items(), ("model.extra.weight", torch.zeros(1))])


def test_fused_projections_hold_hf_rows_in_order(tiny_llama_dir):
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    model = _load_ours(tiny_llama_dir)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    prefix = "model.layers.0."
    expected_qkv = torch.cat([weights[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    expected_gu = torch.cat([weights[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(attn.qkv_proj.weight, expected_qkv)
    assert torch.equal(mlp.gate_up_proj.weight, expected_gu)
