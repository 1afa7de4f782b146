"""Engine vs transformers, token for token, on tiny random checkpoints in fp32.

Greedy output must equal transformers' `generate` under every batching situation the
scheduler can create: one prompt, many concurrent prompts of mixed lengths, chunked
prefill, prefix-cache hits, preemption, and n > 1 (forked blocks with copy-on-write).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

MAX_NEW = 12
ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def _prompts(
    count: int, seed: int = 0, lo: int = 3, hi: int = 40, vocab: int = 500
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _engine_ids(llm: LLM, prompts: list[list[int]], params=None) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params or _greedy(), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


def _llm(model_dir, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    kw.setdefault("dtype", "float32")
    return LLM(str(model_dir), **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_single_and_batched_equal_transformers(arch, tiny_checkpoint, hf_greedy):
    model_dir = tiny_checkpoint(arch)
    prompts = _prompts(30, seed=1)
    ref = hf_greedy(model_dir, prompts, MAX_NEW, ignore_eos=True)
    llm = _llm(model_dir)
    assert _engine_ids(llm, prompts[:1]) == ref[:1]
    assert _engine_ids(llm, prompts) == ref


def test_sliding_window_and_tied_embeddings(tiny_checkpoint, hf_greedy):
    model_dir = tiny_checkpoint("mistral", sliding_window=8, tie_word_embeddings=True)
    prompts = _prompts(6, seed=2, lo=10, hi=30)
    ref = hf_greedy(model_dir, prompts, MAX_NEW, ignore_eos=True)
    assert _engine_ids(_llm(model_dir, max_num_batched_tokens=16), prompts) == ref


def test_llama3_rope_scaling(tiny_checkpoint, hf_greedy):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model_dir = tiny_checkpoint("llama", rope_scaling=scaling)
    prompts = _prompts(4, seed=3)
    ref = hf_greedy(model_dir, prompts, MAX_NEW, ignore_eos=True)
    assert _engine_ids(_llm(model_dir), prompts) == ref


def test_chunked_prefill_equals_transformers(tiny_llama_dir, hf_greedy):
    prompts = _prompts(8, seed=4, lo=20, hi=60)
    ref = hf_greedy(tiny_llama_dir, prompts, MAX_NEW, ignore_eos=True)
    llm = _llm(tiny_llama_dir, max_num_batched_tokens=7, max_num_seqs=4)
    assert _engine_ids(llm, prompts) == ref


def test_prefix_cache_hits_keep_output_exact(tiny_llama_dir, hf_greedy):
    shared = _prompts(1, seed=5, lo=33, hi=33)[0]
    prompts = [shared + tail for tail in _prompts(6, seed=6, lo=1, hi=9)]
    ref = hf_greedy(tiny_llama_dir, prompts, MAX_NEW, ignore_eos=True)
    llm = _llm(tiny_llama_dir)
    assert _engine_ids(llm, prompts[:1]) == ref[:1]
    before = llm.engine.stats().prefix_cache_hits
    assert _engine_ids(llm, prompts[1:]) == ref[1:]
    hits = llm.engine.stats().prefix_cache_hits - before
    assert hits >= 5 * 32  # each later prompt reuses the shared 33-token prefix's full blocks


def test_preemption_keeps_output_exact(tiny_llama_dir, hf_greedy):
    prompts = _prompts(12, seed=7, lo=10, hi=30)
    ref = hf_greedy(tiny_llama_dir, prompts, 20, ignore_eos=True)
    # 24 blocks of 4 slots: far less than 12 requests of up to 50 tokens need at once.
    llm = _llm(tiny_llama_dir, num_kv_blocks=24, enable_prefix_caching=False, max_model_len=64)
    assert _engine_ids(llm, prompts, _greedy(20)) == ref
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().num_free_blocks == 24


def test_n_greater_than_one_forks_and_matches(tiny_llama_dir, hf_greedy):
    prompts = _prompts(3, seed=8, lo=6, hi=14)
    ref = hf_greedy(tiny_llama_dir, prompts, MAX_NEW, ignore_eos=True)
    llm = _llm(tiny_llama_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(n=3), use_tqdm=False)
    for out, expected in zip(outs, ref, strict=True):
        assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert llm.engine.stats().num_free_blocks == 256


def test_greedy_logprobs_match_transformers(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    prompt = _prompts(1, seed=9, lo=12, hi=12)[0]
    llm = _llm(tiny_llama_dir)
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(6, logprobs=3), use_tqdm=False)[0]
    comp = out.outputs[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + comp.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    for i, lp in enumerate(comp.logprobs):
        row = logp[len(prompt) - 1 + i]
        assert lp.token_id == comp.token_ids[i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        assert lp.rank == 1
        top_ids = [t for t, _ in lp.top]
        assert top_ids == row.topk(3).indices.tolist()
    assert abs(comp.cumulative_logprob - sum(lp.logprob for lp in comp.logprobs)) < 1e-6


def test_prompt_logprobs_match_transformers(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    prompt = _prompts(1, seed=10, lo=15, hi=15)[0]
    llm = _llm(tiny_llama_dir, max_num_batched_tokens=6)
    out = llm.generate(
        [{"prompt_token_ids": prompt}], _greedy(2, prompt_logprobs=1), use_tqdm=False
    )[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos]
        assert got.token_id == prompt[pos]
        assert abs(got.logprob - logp[pos - 1, prompt[pos]].item()) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_plain_torch_path_equals_transformers(arch, tiny_checkpoint, hf_greedy):
    """runtime.cpu_kernels: false (no C kernels, no packed weights) is the reference path."""
    model_dir = tiny_checkpoint(arch)
    prompts = _prompts(8, seed=7)
    ref = hf_greedy(model_dir, prompts, MAX_NEW, ignore_eos=True)
    llm = _llm(model_dir, cpu_kernels=False)
    assert not llm.engine.runner.model._cpu_fused
    assert _engine_ids(llm, prompts) == ref
