"""The fused elementwise kernels (engine/worker/kernels/fused.py) against the model's torch ops."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.worker.kernels import fused
from engine.worker.models.cpu_linear import packing_available
from engine.worker.models.layers import RMSNorm, silu_and_mul
from engine.worker.models.rope import apply_rope

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


@pytest.mark.parametrize("rows", [1, 3, 64, 513])
def test_add_rms_norm_matches_residual_add_then_rmsnorm(rows):
    gen = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen) * 3
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.rand(96, generator=gen) + 0.5
    expected_sum = x + res
    expected = norm(expected_sum)
    out = fused.add_rms_norm(x, res, norm.weight, norm.eps)
    assert torch.equal(res, expected_sum)  # the residual stream now holds the sum
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-6)
    # No residual: a plain RMSNorm, input untouched.
    before = x.clone()
    torch.testing.assert_close(fused.add_rms_norm(x, None, norm.weight, norm.eps), norm(x))
    assert torch.equal(x, before)


@pytest.mark.parametrize("rows", [1, 5, 513])
def test_bf16_ops_equal_the_torch_bf16_ops_bit_for_bit(rows):
    """In bf16 the kernels round where transformers' bf16 ops round, so the elementwise ones
    agree exactly. RMSNorm's fp32 sum of squares is added up in another order than torch's
    `mean`, so a value that sits on a bf16 rounding boundary can land one bf16 step away:
    at most one step, and rarely (0 of 393,216 values measured; the test allows 0.1 %)."""
    gen = torch.Generator().manual_seed(rows)
    bf = torch.bfloat16
    x = torch.randn(rows, 96, generator=gen).to(bf)
    res = (torch.randn(rows, 96, generator=gen) * 3).to(bf)
    norm = RMSNorm(96, eps=1e-5).to(bf)
    norm.weight.data = (torch.rand(96, generator=gen) + 0.5).to(bf)
    expected_sum = x + res
    out = fused.add_rms_norm(x, res, norm.weight, norm.eps)
    assert out.dtype == bf and torch.equal(res, expected_sum)
    for got, ref in (
        (out, norm(expected_sum)),
        (fused.add_rms_norm(x, None, norm.weight, norm.eps), norm(x)),
    ):
        torch.testing.assert_close(got.float(), ref.float(), atol=0, rtol=2**-7)  # one bf16 step
        assert (got != ref).float().mean() <= 0.001  # eps 1e-3 for 1e-5 differs at ~0.9 %
    gate_up = (torch.randn(rows, 160, generator=gen) * 8).to(bf)
    assert torch.equal(fused.silu_and_mul(gate_up), silu_and_mul(gate_up))
    H, Hkv, D, P = 4, 2, 32, 256
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.arange(P).float()[:, None] * inv[None]
    cos, sin = torch.cat([emb, emb], -1).cos(), torch.cat([emb, emb], -1).sin()
    qkv = torch.randn(rows, (H + 2 * Hkv) * D, generator=gen).to(bf)
    positions = torch.randint(0, P, (rows,), generator=gen)
    c, s = cos[positions][:, None].to(bf), sin[positions][:, None].to(bf)
    q_ref = apply_rope(qkv[:, : H * D].reshape(rows, H, D), c, s)
    k_ref = apply_rope(qkv[:, H * D : (H + Hkv) * D].reshape(rows, Hkv, D), c, s)
    fused.rope_inplace(qkv[:, : (H + Hkv) * D], H + Hkv, D, positions, cos.to(bf), sin.to(bf))
    assert torch.equal(qkv[:, : H * D].reshape(rows, H, D), q_ref)
    assert torch.equal(qkv[:, H * D : (H + Hkv) * D].reshape(rows, Hkv, D), k_ref)


def test_mixed_dtypes_are_refused():
    w = torch.ones(8)
    with pytest.raises(AssertionError):
        fused.add_rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), None, w, 1e-6)
    with pytest.raises(AssertionError):
        fused.silu_and_mul(torch.ones(2, 8, dtype=torch.float16))


def test_add_rms_norm_reads_a_strided_row_view():
    big = torch.randn(10, 200)
    view = big[:, 50:114]  # rows 200 apart
    w = torch.rand(64)
    norm = RMSNorm(64)
    norm.weight.data = w
    torch.testing.assert_close(fused.add_rms_norm(view, None, w, norm.eps), norm(view))


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_silu_and_mul_matches_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 80, generator=gen) * 8  # covers the exp's whole range
    torch.testing.assert_close(fused.silu_and_mul(gate_up), silu_and_mul(gate_up))


def test_silu_handles_extremes():
    g = torch.tensor([-1e4, -100.0, -88.0, -20.0, 0.0, 1e-30, 20.0, 88.0, 100.0, 1e4])
    gate_up = torch.cat([g, torch.ones_like(g)])[None]
    torch.testing.assert_close(fused.silu_and_mul(gate_up)[0], torch.nn.functional.silu(g))


@pytest.mark.parametrize("rows", [1, 5, 200])
def test_rope_inplace_matches_apply_rope_on_q_and_k_of_qkv(rows):
    gen = torch.Generator().manual_seed(rows)
    H, Hkv, D, P = 6, 2, 32, 512
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(P).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()
    qkv = torch.randn(rows, (H + 2 * Hkv) * D, generator=gen)
    positions = torch.randint(0, P, (rows,), generator=gen)
    q = qkv[:, : H * D].reshape(rows, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].reshape(rows, Hkv, D)
    v_before = qkv[:, (H + Hkv) * D :].clone()
    c, s = cos[positions][:, None], sin[positions][:, None]
    q_ref, k_ref = apply_rope(q, c, s), apply_rope(k, c, s)
    fused.rope_inplace(qkv[:, : (H + Hkv) * D], H + Hkv, D, positions, cos, sin)
    torch.testing.assert_close(qkv[:, : H * D].reshape(rows, H, D), q_ref)
    torch.testing.assert_close(qkv[:, H * D : (H + Hkv) * D].reshape(rows, Hkv, D), k_ref)
    assert torch.equal(qkv[:, (H + Hkv) * D :], v_before)  # v is not rotated


def test_fused_forward_refuses_positions_past_the_rotary_table(tiny_checkpoint):
    from engine import LLM

    llm = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=16, block_size=4, max_model_len=64)
    model = llm.engine.runner.model
    assert model._cpu_fused
    from engine.worker.models import cpu_fused

    too_far = torch.tensor([model.model.rotary_emb.cos_cache.shape[0]])
    with pytest.raises(ValueError, match="rotary table"):
        cpu_fused.forward(model, torch.tensor([1]), too_far, ctx=None)


def test_bf16_model_runs_the_kernels_and_packed_linears_and_matches_the_plain_path(
    tiny_checkpoint,
):
    """The bf16 path must not fall back to plain torch ops (how bf16 once ran at 0.25x vLLM):
    every linear is packed in bf16, the fused forward is on, and its prompt logprobs equal
    the plain bf16 path's to within GEMM blocking differences (0.0 measured here)."""
    from torch import nn

    from engine import LLM, SamplingParams

    path = str(tiny_checkpoint("llama"))
    kw = dict(dtype="bfloat16", num_kv_blocks=64, block_size=4, max_model_len=64)
    fast, plain = LLM(path, **kw), LLM(path, cpu_kernels=False, **kw)
    model = fast.engine.runner.model
    assert model._cpu_fused
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears
    if packing_available(torch.bfloat16):
        assert all(m.packed_weight.dtype == torch.bfloat16 for m in linears)
    else:  # AVX2-only CPUs: oneDNN cannot pack bf16; the fused kernels still run
        assert not any(hasattr(m, "packed_weight") for m in linears)
    assert not plain.engine.runner.model._cpu_fused
    prompt = {"prompt_token_ids": [5 + (7 * i) % 400 for i in range(40)]}
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    got, ref = (
        [e.logprob for e in llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs[1:]]
        for llm in (fast, plain)
    )
    assert len(got) == len(ref) == 39
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= 0.02
