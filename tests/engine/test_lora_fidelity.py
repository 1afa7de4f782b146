"""Engine with LoRA adapters vs PEFT, token for token, on tiny random checkpoints in fp32.

The reference is PEFT's own unmerged `PeftModel` over the transformers model, on adapters
PEFT wrote (`tests/support/tiny_lora.py`, random non-zero A and B). Every architecture runs
an adapter on all seven projections; a mixed batch (three adapters of different ranks,
targets and scalings, plus the base model) must equal each run alone, on the packed-linear
CPU path and on the plain one, with chunked prefills beside decodes; two device slots for
three adapters must evict and reload without changing a token; and two adapters never
share a cached prompt block.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.support.tiny_lora import make_tiny_adapter, peft_greedy

MAX_NEW = 10
ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def _prompts(count: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _llm(model_dir, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    kw.setdefault("dtype", "float32")
    return LLM(str(model_dir), enable_lora=True, max_lora_rank=8, **kw)


def _run(llm: LLM, prompts, loras) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    """Three adapters on the tiny llama: all modules r=8; attention only r=4 with rsLoRA and
    per-module rank/alpha; the MLP by regex, r=2."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "all": dict(r=8, alpha=16, seed=1),
        "attn": dict(
            targets=["q_proj", "k_proj", "v_proj", "o_proj"],
            r=4,
            alpha=8,
            use_rslora=True,
            rank_pattern={"o_proj": 2},
            alpha_pattern={r"layers\.0\.self_attn\.k_proj": 2},
            seed=2,
        ),
        "mlp": dict(targets=r".*\.(gate_proj|up_proj|down_proj)", r=2, alpha=4, seed=3),
    }
    return {
        name: LoRARequest(name, i + 1, str(make_tiny_adapter(tiny_llama_dir, root / name, **kw)))
        for i, (name, kw) in enumerate(specs.items())
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_greedy_equals_peft(arch, tiny_checkpoint, hf_greedy, tmp_path):
    model_dir = tiny_checkpoint(arch)
    adapter = make_tiny_adapter(model_dir, tmp_path / "adapter", r=8, alpha=16, seed=4)
    prompts = _prompts(4, seed=1)
    ref = peft_greedy(model_dir, adapter, prompts, MAX_NEW)
    base = hf_greedy(model_dir, prompts, MAX_NEW, ignore_eos=True)
    assert ref != base  # the adapter changes the output
    got = _run(_llm(model_dir), prompts, LoRARequest("a", 1, str(adapter)))
    assert got == ref


MIXED_PROMPTS = _prompts(12, seed=2, lo=3, hi=40)
MIXED_NAMES = [["all", "attn", "mlp", None][i % 4] for i in range(len(MIXED_PROMPTS))]


@pytest.fixture(scope="module")
def mixed_expected(tiny_llama_dir, adapters, hf_greedy) -> list[list[int]]:
    """Each prompt's tokens run alone with its adapter (PEFT) or the base (transformers)."""
    base = hf_greedy(tiny_llama_dir, MIXED_PROMPTS, MAX_NEW, ignore_eos=True)
    expected = []
    for prompt, name, alone in zip(MIXED_PROMPTS, MIXED_NAMES, base, strict=True):
        if name is not None:
            (alone,) = peft_greedy(tiny_llama_dir, adapters[name].lora_path, [prompt], MAX_NEW)
        expected.append(alone)
    assert sum(e != b for e, b in zip(expected, base, strict=True)) == 9  # adapters change it
    return expected


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["packed", "plain"])
def test_mixed_batch_equals_each_adapter_alone(
    cpu_kernels, tiny_llama_dir, adapters, mixed_expected
):
    # A small token budget: prefill chunks of one adapter share steps with others' decodes.
    llm = _llm(tiny_llama_dir, cpu_kernels=cpu_kernels, max_num_batched_tokens=24)
    assert llm.engine.runner.model._cpu_fused is cpu_kernels
    loras = [None if n is None else adapters[n] for n in MIXED_NAMES]
    assert _run(llm, MIXED_PROMPTS, loras) == mixed_expected


def test_two_slots_for_three_adapters_evict_and_stay_exact(tiny_llama_dir, adapters):
    prompts = _prompts(9, seed=3)
    names = ["all", "attn", "mlp"] * 3
    expected = [
        peft_greedy(tiny_llama_dir, adapters[n].lora_path, [p], MAX_NEW)[0]
        for n, p in zip(names, prompts, strict=True)
    ]
    llm = _llm(tiny_llama_dir, max_loras=2, max_num_seqs=4)
    assert _run(llm, prompts, [adapters[n] for n in names]) == expected
    assert llm.engine.runner.lora.slots.num_loads > 3  # an adapter came back after eviction


def test_prefix_cache_blocks_are_never_shared_between_adapters(tiny_llama_dir, adapters):
    prompt = _prompts(1, seed=5, lo=33, hi=33)[0]  # 8 full blocks of 4
    a, b = adapters["all"], adapters["attn"]
    llm = _llm(tiny_llama_dir)
    hits = lambda: llm.engine.stats().prefix_cache_hits  # noqa: E731
    assert _run(llm, [prompt], a) == peft_greedy(tiny_llama_dir, a.lora_path, [prompt], MAX_NEW)
    assert hits() == 0
    assert _run(llm, [prompt], b) == peft_greedy(tiny_llama_dir, b.lora_path, [prompt], MAX_NEW)
    assert _run(llm, [prompt], None) != _run(llm, [prompt], a)
    before = hits()
    assert before == 32  # only the second base-model run hit (the first base run's blocks)
    _run(llm, [prompt], a)
    assert hits() == before + 32  # adapter a's own blocks
