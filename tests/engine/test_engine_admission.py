"""LLMEngine admission: the one rule of `engine.core.admission`, seen from the entry point.

A request is admitted when, at its longest, its K/V fits the whole pool: K/V is stored for
every token but the last sampled one, so `ceil((prompt + max_tokens - 1) / block_size)`
blocks. Start-up refuses a pool smaller than one max_model_len request, so at the entry
point the context limit is the one a request meets first; the pool's own refusal is pinned
in tests/core/test_admission_rule.py.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import ContextLengthError, InvalidRequestError

BLOCK = 4
NUM_BLOCKS = 4  # 16 tokens of K/V in the whole pool
MAX_MODEL_LEN = NUM_BLOCKS * BLOCK + 1  # the longest request holds exactly the pool


@pytest.fixture(scope="module")
def small_pool(tiny_llama_dir) -> LLM:
    return LLM(
        str(tiny_llama_dir), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, dtype="float32",
        max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False,
    )  # fmt: skip


def test_request_needing_exactly_the_whole_pool_is_admitted_and_finishes(small_pool):
    prompt = list(range(10, 20))  # 10 tokens; + 7 outputs = K/V for 16 tokens: the pool
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    out = small_pool.generate([prompt], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7
    assert out.outputs[0].finish_reason == "length"
    assert small_pool.engine.stats().num_free_blocks == NUM_BLOCKS


def test_one_token_more_than_the_pool_is_refused_naming_max_tokens(small_pool):
    with pytest.raises(ContextLengthError) as e:
        small_pool.engine.prepare_request("r", list(range(10, 20)), SamplingParams(max_tokens=8))
    assert e.value.param == "max_tokens"


def test_context_overflow_is_a_context_length_error(small_pool):
    with pytest.raises(ContextLengthError) as e:
        small_pool.engine.prepare_request("r", [5] * 17, SamplingParams())
    assert e.value.param == "prompt" and "maximum context length is 17" in str(e.value)


def test_duplicate_id_is_refused_while_held_and_free_again_after(small_pool):
    eng = small_pool.engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    eng.add_request("dup", [7, 8], params)
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("dup", [7, 8], SamplingParams(n=2, max_tokens=2))
    assert e.value.param == "request_id" and "'dup'" in str(e.value)
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("dup", [7, 8], params)  # finished: the id is free again
    eng.abort("dup")
    assert not eng.has_unfinished_requests()
