"""Prompt scoring through the engine: `prompt_logprobs` (every prompt token computed, even
when its blocks are cached) and `max_tokens=0` (prefill, score, generate nothing).

The reference is transformers' log-softmax on the same tiny fp32 checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.output.request_output import RequestOutput
from engine.sampling_params import SamplingParamsError
from tests.support.offline import run_to_finals

PROMPT = [17, 302, 45, 9, 250, 33, 71, 120, 8, 64, 199, 5, 77, 310]  # 14 tokens: 3 full blocks


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(
        str(tiny_llama_dir), num_kv_blocks=64, block_size=4, dtype="float32", max_model_len=128
    )


@pytest.fixture(scope="module")
def hf_logp(tiny_llama_dir) -> torch.Tensor:
    """[len(PROMPT), V] log-softmax of transformers' logits over PROMPT."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def _run(llm: LLM, rid: str, params: SamplingParams, **kw) -> RequestOutput:
    """One request through the engine's own loop (so `cache_salt` can be passed)."""
    eng = llm.engine
    eng.add_request(rid, {"prompt_token_ids": PROMPT}, params, **kw)
    return run_to_finals(eng)[rid]


def _scores(out: RequestOutput) -> list[float]:
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    return [lp.logprob for lp in out.prompt_logprobs[1:]]


def _assert_match_transformers(out: RequestOutput, hf_logp: torch.Tensor) -> None:
    assert len(out.prompt_logprobs) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        got = out.prompt_logprobs[pos]
        assert got.token_id == PROMPT[pos]
        assert abs(got.logprob - hf_logp[pos - 1, PROMPT[pos]].item()) < 1e-4


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm, hf_logp):
    eng = llm.engine
    out = _run(llm, "score", SamplingParams(max_tokens=0, prompt_logprobs=2, logprobs=1))
    comp = out.outputs[0]
    assert comp.token_ids == [] and comp.text == ""
    assert comp.logprobs == []  # the sample drawn after the prompt is dropped with its token
    assert comp.finish_reason == "length" and comp.stop_reason is None
    _assert_match_transformers(out, hf_logp)
    eng.step()  # the runner hears of the finish
    assert eng.stats().num_free_blocks == eng.stats().num_blocks


def test_max_tokens_zero_is_refused_without_prompt_logprobs():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(max_tokens=0)
    assert e.value.param == "max_tokens"
    with pytest.raises(SamplingParamsError):
        SamplingParams(max_tokens=-1, prompt_logprobs=0)


def test_prompt_logprobs_are_complete_when_the_prompt_is_cached(tiny_llama_dir, hf_logp):
    """A request that asks for prompt logprobs reads nothing from the prefix cache, whatever
    its cache_salt (a client-chosen salt shares the cache with that client's other requests),
    while its own blocks still serve later plain requests."""
    llm = LLM(
        str(tiny_llama_dir), num_kv_blocks=64, block_size=4, dtype="float32", max_model_len=128
    )
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    first = _run(llm, "first", scoring, cache_salt="tenant")
    _assert_match_transformers(first, hf_logp)
    warm = _run(llm, "plain", plain, cache_salt="tenant")
    assert warm.metrics.num_cached_tokens == 12  # the scoring request's blocks are reused
    again = _run(llm, "again", scoring, cache_salt="tenant")
    assert again.metrics.num_cached_tokens == 0
    assert _scores(again) == pytest.approx(_scores(first), abs=1e-6)
    unsalted = _run(llm, "unsalted", scoring)
    assert _scores(unsalted) == pytest.approx(_scores(first), abs=1e-6)


def test_a_preempted_scoring_request_keeps_one_entry_per_prompt_token(tiny_llama_dir, hf_logp):
    """12 blocks of 4 hold two 14-token prompts but not their 20 outputs each: the newer
    request, the scoring one, is preempted and computes its prompt again on resuming."""
    llm = LLM(
        str(tiny_llama_dir), num_kv_blocks=12, block_size=4, dtype="float32", max_model_len=48
    )
    other = list(range(40, 54))
    outs = llm.generate(
        [{"prompt_token_ids": other}, {"prompt_token_ids": PROMPT}],
        [
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1),
        ],
        use_tqdm=False,
    )
    assert outs[1].metrics.preempted_times  # the premise: it was preempted
    _assert_match_transformers(outs[1], hf_logp)
