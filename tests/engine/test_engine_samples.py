"""LLMEngine across the life of samples: preemption, aborts, id reuse, n > 1 forks."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.request import RequestStatus
from tests.support.offline import run_to_finals

SEEDED = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def small_pool(tiny_llama_dir) -> LLM:
    # 6 blocks of 4: two 8-token prompts decoding 12 tokens each cannot both stay resident.
    return LLM(
        str(tiny_llama_dir), num_kv_blocks=6, block_size=4, dtype="float32", max_model_len=24,
        enable_prefix_caching=False,
    )  # fmt: skip


def _drain(eng) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in run_to_finals(eng).items()}


def test_id_reused_after_aborting_a_preempted_seeded_request_samples_afresh(small_pool):
    eng = small_pool.engine
    eng.add_request("ref", list(range(30, 38)), SEEDED)
    reference = _drain(eng)["ref"]

    eng.add_request("a", list(range(10, 18)), SEEDED)
    eng.add_request("s", list(range(30, 38)), SEEDED)
    for _ in range(50):
        eng.step()
        if eng.scheduler.get_request("s").status is RequestStatus.PREEMPTED:
            break
    assert eng.scheduler.get_request("s").status is RequestStatus.PREEMPTED
    eng.abort("s")
    _drain(eng)

    eng.add_request("s", list(range(30, 38)), SEEDED)
    assert _drain(eng)["s"] == reference


def test_n2_prompt_logprobs_have_one_entry_per_prompt_token(tiny_llama_dir):
    """max_tokens=1: the first sample finishes before the second can fork from it, so the
    second prefills the prompt itself; its prompt logprobs must not be added again."""
    llm = LLM(
        str(tiny_llama_dir), num_kv_blocks=64, block_size=4, dtype="float32", max_model_len=256
    )
    prompt = list(range(40, 50))
    one = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    params = SamplingParams(n=2, max_tokens=1, prompt_logprobs=1, temperature=1.0, seed=3)
    two = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(two.outputs) == 2
    assert len(two.prompt_logprobs) == len(prompt) and two.prompt_logprobs[0] is None
    assert [lp.token_id for lp in two.prompt_logprobs[1:]] == prompt[1:]
    assert [lp.logprob for lp in two.prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in one[0].prompt_logprobs[1:]], abs=1e-5
    )
