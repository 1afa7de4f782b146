"""The quantized path through the whole engine: greedy output of a quantized model does not
depend on how the scheduler batches it (alone, batched, chunked prefill, prefix-cache hits,
preemption), and the tied LM head / fused projections / LoRA run on quantized layers."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.kernels import quant as qkernels
from engine.worker.lora.batch import build_lora_batch
from engine.worker.lora.layers import LoRALinear, LoRAStep
from engine.worker.quant.blocks import Q8
from engine.worker.quant.linear import QuantLinear

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="no C compiler")


def _prompts(count, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _ids(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_greedy_is_independent_of_batching(method, tiny_checkpoint):
    model_dir = str(tiny_checkpoint("qwen3", tie_word_embeddings=True))
    prompts = _prompts(12, seed=5)
    shared = [prompts[0][:3] * 6 + p for p in prompts[:4]]  # a 18-token common prefix

    def llm(**kw):
        kw.setdefault("num_kv_blocks", 256)
        return LLM(model_dir, quantization=method, dtype="float32", block_size=4, **kw)

    alone = llm(enable_prefix_caching=False)
    ref = [_ids(alone, [p])[0] for p in prompts + shared]
    assert _ids(llm(), prompts) == ref[:12]  # batched
    assert _ids(llm(max_num_batched_tokens=7, max_num_seqs=4), prompts) == ref[:12]  # chunked
    cached = llm()
    assert _ids(cached, shared) == ref[12:] and _ids(cached, shared) == ref[12:]  # prefix hits
    small = llm(num_kv_blocks=20, max_model_len=64)  # 12 requests of up to 13 blocks: preempts
    assert _ids(small, prompts) == ref[:12]


def test_lora_product_stays_float_beside_a_quantized_base():
    torch.manual_seed(0)
    base = QuantLinear(64, 48, False, target=Q8, shard_sizes={"q": 32, "k": 16})
    base.load_tensor("weight", "q", torch.randn(32, 64) * 0.1)
    base.load_tensor("weight", "k", torch.randn(16, 64) * 0.1)
    base.finalize()
    step = LoRAStep()
    lora = LoRALinear(base, 0, ("q_proj", "k_proj"), max_loras=2, max_rank=4, step=step)
    assert lora.lora_a.dtype == torch.float32 and lora.lora_a.shape == (2, 64, 8)
    a, b = torch.randn(4, 64), torch.randn(16, 4)
    lora.load_slot(1, {(0, "k_proj"): (a, b)})
    x = torch.randn(3, 64)
    step.batch = build_lora_batch(np.array([1]), np.array([3]))  # one request, slot 1
    y = lora(x)
    expected = base(x)
    expected[:, 32:] += x @ a.t() @ b.t()
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
