"""Greedy output with speculative decoding equals greedy output without it, token for token
(and text, and finish reasons), for every proposer.

Coverage is pairwise, inside the CI budget: one full pass per proposer on Llama (batching,
chunked prefill, prefix-cache hits, preemption under a tight KV pool, n > 1 and a stop
string, all in one workload), and each other architecture with one proposer on a lighter
workload. Structured outputs, LoRA and tensor parallelism have their own tests. Every test
checks through the speculation counters that proposals were made, some accepted and some
rejected: a proposer that never fires, or whose proposals are always rejected, fails here.

The tiny checkpoints use weight_std 0.05: flatter logits make a random model fall into
repeating runs with changes between them, so proposals are both accepted and rejected.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench.spec_draft import write_truncated_copy
from engine import LLM, SamplingParams

MAX_NEW = 40
STD = 0.05


def _checkpoint(tiny_checkpoint, arch: str) -> Path:
    return tiny_checkpoint(arch, weight_std=STD)


def _draft_of(target: Path) -> Path:
    """The target's first layer as its draft, built once next to it."""
    out = target.parent / (target.name + "-draft1")
    if not (out / "config.json").exists():
        write_truncated_copy(target, out, 1)
    return out


def _speculative(method: str, target: Path, k: int = 4) -> dict:
    cfg = {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 1}
    if method == "draft":
        cfg = {"model": str(_draft_of(target)), "num_speculative_tokens": k}
    return cfg


def _llm(model_dir: Path, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    return LLM(str(model_dir), dtype="float32", speculative_config=spec, **kw)


def _greedy(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_NEW)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, **kw)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(16)]
    short = [[rng.randrange(3, 500) for _ in range(rng.randint(3, 12))] for _ in range(5)]
    long = [[rng.randrange(3, 500) for _ in range(45)]]  # chunked: the budget is 16
    return short + long + [shared + [7, 8], shared + [9, 10, 11]]  # the last two share 4 blocks


def _run(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        tuple((c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs)
        for o in outs
    ]


def _full_workload(model_dir: Path, spec: dict | None, stop: str | None):
    """Batching, chunked prefill, prefix hits, preemption (48 blocks of 4 for ~130 tokens
    of 8 concurrent requests), n = 2, and a stop string on one request."""
    llm = _llm(model_dir, spec, num_kv_blocks=40, max_num_batched_tokens=16, max_num_seqs=8)
    prompts = _prompts(3)
    params = [_greedy() for _ in prompts]
    params[1] = _greedy(n=2)
    params[2] = _greedy(stop=[stop] if stop else [], ignore_eos=False)
    out = _run(llm, prompts, params)
    return out, llm.engine.stats()


def _assert_speculated(stats) -> None:
    spec = stats.spec_decode
    assert spec is not None and spec.num_drafts > 0
    assert spec.num_draft_tokens > spec.num_accepted_tokens > 0  # some accepted, some not


@pytest.fixture(scope="module")
def llama_reference(tiny_checkpoint):
    """Llama's output without speculation, and the stop string used: a few characters from
    the middle of one request's own text, so it ends that request early."""
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    first, _ = _full_workload(model_dir, None, None)
    text = first[2][0][1]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    out, stats = _full_workload(model_dir, None, stop)
    assert out[2][0][2] == "stop" and out[2][0][3] == stop
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return model_dir, stop, out


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_full_pass_equals_the_output_without_speculation(method, llama_reference):
    model_dir, stop, expected = llama_reference
    got, stats = _full_workload(model_dir, _speculative(method, model_dir), stop)
    assert got == expected
    _assert_speculated(stats)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_blocks  # nothing held once idle


@pytest.mark.parametrize(
    ("arch", "method"), [("mistral", "suffix"), ("qwen2", "draft"), ("qwen3", "ngram")]
)
def test_every_architecture_equals_its_output_without_speculation(arch, method, tiny_checkpoint):
    model_dir = _checkpoint(tiny_checkpoint, arch)
    prompts = _prompts(11)
    expected = _run(_llm(model_dir, max_num_batched_tokens=16), prompts, _greedy())
    llm = _llm(model_dir, _speculative(method, model_dir), max_num_batched_tokens=16)
    assert _run(llm, prompts, _greedy()) == expected
    _assert_speculated(llm.engine.stats())


def test_a_fixed_k_without_the_adaptive_rule_equals_too(llama_reference):
    """adaptive false: every decode proposes num_speculative_tokens when it can."""
    model_dir, _, _ = llama_reference
    prompts = _prompts(5)
    expected = _run(_llm(model_dir), prompts, _greedy())
    spec = {**_speculative("ngram", model_dir, k=6), "adaptive": False}
    llm = _llm(model_dir, spec)
    assert _run(llm, prompts, _greedy()) == expected
    _assert_speculated(llm.engine.stats())
