"""What the runner hands the sampler per request and step.

A decode step must not cost O(prompt + output) Python per request: the token ids reach the
sampler only for requests whose penalties read them, and then as the runner's own list.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.worker.sampler import Sampler, SamplingRow


class RecordingSampler(Sampler):
    def __init__(self) -> None:
        self.steps: list[list[SamplingRow]] = []

    def __call__(self, logits, rows, grammar_bitmask=None):
        self.steps.append(list(rows))
        return super().__call__(logits, rows, grammar_bitmask)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(
        str(tiny_llama_dir), num_kv_blocks=64, block_size=4, dtype="float32", max_model_len=256
    )


def test_plain_requests_pass_no_token_lists_and_penalties_pass_the_state_list(llm):
    eng = llm.engine
    recorder = eng.runner.sampler = RecordingSampler()
    try:
        eng.add_request("plain", list(range(20, 30)), SamplingParams(max_tokens=3, min_tokens=2))
        eng.add_request(
            "pen", list(range(20, 26)), SamplingParams(max_tokens=3, repetition_penalty=1.3)
        )
        eng.step()
        eng.step()  # decode: both now hold one output token
        plain, pen = recorder.steps[-1]
        assert plain.token_ids == () and plain.num_output_tokens == 1
        assert plain.num_prompt_tokens == 10
        state = eng.runner.states["pen"]
        assert pen.token_ids is state.token_ids  # the runner's own list, not a copy
        assert (pen.num_prompt_tokens, pen.num_output_tokens) == (6, 1)
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        eng.runner.sampler = Sampler()
