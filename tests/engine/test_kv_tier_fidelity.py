"""Greedy output is the same with and without the KV disk tier, on every architecture, with
a pool too small for the working set (so returning turns are served from the tier), under
preemption, n > 1, LoRA adapters (keyed by adapter: another adapter never hits) and cache
salts (a salted prefix is never served to another salt)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.lora_request import LoRARequest
from tests.support.offline import run_to_finals

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
# 16 blocks of 4: one 64-token request at most, so four conversations never fit together.
SMALL_POOL = dict(num_kv_blocks=16, block_size=4, max_model_len=64, dtype="float32")


def _llm(model_dir, tier_dir=None, **kw) -> LLM:
    return LLM(str(model_dir), **{**SMALL_POOL, **kw}, disk_tier_dir=tier_dir and str(tier_dir))


def _greedy(n: int = 1, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def _conversations(count: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(26 + 3 * i)] for i in range(count)]


def _two_turns(llm: LLM, firsts: list[list[int]], n: int = 1, lora=None) -> list[list[list[int]]]:
    """Turn 1 of each conversation, then turn 2 = turn 1 + its answer + 4 new tokens, one
    conversation after the other, so each returns after the others evicted it."""
    outs = llm.generate([{"prompt_token_ids": p} for p in firsts], _greedy(n), False, lora)
    answers = [[c.token_ids for c in o.outputs] for o in outs]
    seconds = [p + a[0] + [7, 8, 9, 10] for p, a in zip(firsts, answers, strict=True)]
    for p in seconds:
        out = llm.generate({"prompt_token_ids": p}, _greedy(n), False, lora)[0]
        answers.append([c.token_ids for c in out.outputs])
    return answers


def _tier_hits(llm: LLM) -> int:
    return llm.engine.stats().kv_tier.hit_tokens["disk"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_is_identical_with_the_disk_tier_serving_returning_turns(
    arch, tiny_checkpoint, tmp_path
):
    model_dir = tiny_checkpoint(arch)
    firsts = _conversations()
    want = _two_turns(_llm(model_dir), firsts)
    llm = _llm(model_dir, tmp_path / "tier")
    assert _two_turns(llm, firsts) == want
    assert _tier_hits(llm) >= 4 * 24  # every returning turn read its first turn back
    assert llm.engine.stats().num_preemptions > 0  # four at once never fit
    run_to_finals(llm.engine)  # the last saves' copies come back in a step
    assert llm.engine.stats().num_free_blocks == 16


def test_n_greater_than_one_with_the_tier(tiny_llama_dir, tmp_path):
    firsts = _conversations(3, seed=1)
    want = _two_turns(_llm(tiny_llama_dir), firsts, n=2)
    llm = _llm(tiny_llama_dir, tmp_path / "tier")
    assert _two_turns(llm, firsts, n=2) == want
    assert _tier_hits(llm) > 0


def test_lora_blocks_are_keyed_by_adapter(tiny_llama_dir, tmp_path):
    from tests.support.tiny_lora import make_tiny_adapter

    a = LoRARequest("a", 1, str(make_tiny_adapter(tiny_llama_dir, tmp_path / "a", seed=1)))
    b = LoRARequest("b", 2, str(make_tiny_adapter(tiny_llama_dir, tmp_path / "b", seed=2)))
    firsts = _conversations(3, seed=2)
    lora = dict(enable_lora=True, max_lora_rank=8)
    want_a = _two_turns(_llm(tiny_llama_dir, **lora), firsts, lora=a)
    want_b = _llm(tiny_llama_dir, **lora).generate(
        [{"prompt_token_ids": p} for p in firsts], _greedy(), False, b
    )
    llm = _llm(tiny_llama_dir, tmp_path / "tier", **lora)
    assert _two_turns(llm, firsts, lora=a) == want_a
    hits = _tier_hits(llm)
    assert hits > 0
    # The same prompts under adapter b: a's blocks (in the pool and the tier) never serve.
    got_b = llm.generate([{"prompt_token_ids": p} for p in firsts], _greedy(), False, b)
    assert [o.outputs[0].token_ids for o in got_b] == [o.outputs[0].token_ids for o in want_b]
    assert all(o.metrics.num_cached_tokens == 0 for o in got_b)
    assert _tier_hits(llm) == hits


def test_a_salted_prefix_is_never_served_to_another_salt(tiny_llama_dir, tmp_path):
    llm = _llm(tiny_llama_dir, tmp_path / "tier")
    eng = llm.engine
    prompt, filler = _conversations(2, seed=3)

    def run(rid: str, tokens: list[int], salt: str | None):
        eng.add_request(rid, tokens, _greedy(), cache_salt=salt)
        return run_to_finals(eng)[rid]

    first = run("a1", prompt, "tenant-a")
    run("f", filler + filler[:20], None)  # evicts a's blocks from the small pool
    other = run("b1", prompt, "tenant-b")
    assert other.metrics.num_cached_tokens == 0
    assert other.outputs[0].token_ids == first.outputs[0].token_ids
    run("f2", filler[::-1] + filler[:20], None)
    again = run("a2", prompt, "tenant-a")
    assert again.metrics.num_cached_tokens == 24 and _tier_hits(llm) == 24
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
