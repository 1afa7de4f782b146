"""The prefill attention kernel (csrc/prefill_attention.c) against SDPA, and in the engine.

Chunks of many lengths in one call (1 token, around the 8-row and 32-key tiles, longer
than a few tiles), grouped-query ratios, head sizes 64 and 128, fp32 and bf16, q/k/v as
strided views of one fused QKV output, rows outside the chunks left alone; a head size it
does not serve is declined, not computed wrong. In the engine: greedy output with the
kernel in the path (head size 64) still equals transformers', with and without chunking.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.worker.kernels import attention as native

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


def _avx512() -> bool:
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ).split()
    except (OSError, StopIteration):
        return False
    return {"avx512f", "avx512bw", "avx512vl"} <= set(flags)


def _step(lens, H, Hkv, D, dtype, seed=0, spare=3):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens) + spare
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=1)
    chunks, start = [], spare  # the first rows belong to no chunk
    for n in lens:
        chunks.append((start, start + n))
        start += n
    return q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D), chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(8, 4, 64), (9, 3, 64), (4, 1, 128), (2, 2, 64)])
def test_chunks_equal_causal_sdpa(dtype, H, Hkv, D):
    lens = [1, 5, 8, 9, 31, 32, 33, 150, 300]
    q, k, v, chunks = _step(lens, H, Hkv, D, dtype, seed=H + D)
    out = torch.full_like(q, 7.0)
    done = native.prefill_attention(q, k, v, out, chunks, D**-0.5)
    if not _avx512():
        assert not done
        pytest.skip("the kernel runs on AVX-512 builds only")
    assert done
    for start, end in chunks:
        ref = F.scaled_dot_product_attention(
            *(t[start:end].float().transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
            is_causal=True,
            scale=D**-0.5,
            enable_gqa=True,
        )[0].transpose(0, 1)
        if dtype == torch.bfloat16:  # fp32 inside, the result rounded once
            ref, tol = ref.to(dtype).float(), 8e-3
        else:
            tol = 1e-5
        torch.testing.assert_close(out[start:end].float(), ref, atol=tol, rtol=tol)
    assert torch.all(out[: chunks[0][0]] == 7.0)


def test_a_head_size_it_does_not_serve_is_declined():
    q, k, v, chunks = _step([10, 20], 6, 2, 40, torch.float32)
    out = torch.full_like(q, 7.0)
    assert not native.prefill_attention(q, k, v, out, chunks, 40**-0.5)
    assert torch.all(out == 7.0)


@pytest.mark.skipif(not _avx512(), reason="the kernel runs on AVX-512 builds only")
@pytest.mark.parametrize("batched_tokens", [None, 24])
def test_the_engine_with_the_kernel_equals_transformers(tiny_checkpoint, hf_greedy, batched_tokens):
    """Head size 64 (hidden 128, 2 heads, 1 KV head): whole prompts take the kernel; with
    24-token steps the later chunks of long prompts see a cached prefix and take SDPA."""
    model_dir = tiny_checkpoint(
        "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64
    )
    prompts = [[(11 * i + 5 * j) % 480 + 3 for j in range(2 + 7 * i)] for i in range(10)]
    ref = hf_greedy(model_dir, prompts, 8, ignore_eos=True)
    kw = {} if batched_tokens is None else {"max_num_batched_tokens": batched_tokens}
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, block_size=4, **kw)
    calls = []
    original = native.prefill_attention

    def spy(*args, **kwargs):
        calls.append(len(args[4]))
        return original(*args, **kwargs)

    native.prefill_attention = spy
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        native.prefill_attention = original
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert calls, "no prefill chunk took the kernel"
