"""TorchPagedBackend against a naive per-request, per-query reference."""

from __future__ import annotations

import math

import pytest
import torch

from engine.worker.attention.base import AttentionLayerSpec
from engine.worker.attention.torch_paged import TorchPagedBackend
from tests.support.paged_harness import build_metadata

BLOCK = 4
H, HKV, D = 4, 2, 8


def _spec(window: int | None = None, cap: float | None = None) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        H, HKV, D, 1 / math.sqrt(D), sliding_window=window, logits_soft_cap=cap
    )


def _reference(q, k_all, v_all, seq_len, spec):
    """q [n, H, D] for the last n positions of a sequence whose K/V are k_all/v_all [S, Hkv, D]."""
    n, g = q.shape[0], spec.num_heads // spec.num_kv_heads
    out = torch.empty_like(q)
    for i in range(n):
        p = seq_len - n + i
        lo = 0 if spec.sliding_window is None else max(0, p - spec.sliding_window + 1)
        for h in range(spec.num_heads):
            keys, vals = k_all[lo : p + 1, h // g], v_all[lo : p + 1, h // g]
            s = (keys @ q[i, h]) * spec.scale
            if spec.logits_soft_cap is not None:
                s = torch.tanh(s / spec.logits_soft_cap) * spec.logits_soft_cap
            out[i, h] = torch.softmax(s, dim=0) @ vals
    return out


@pytest.fixture(params=[True, False], ids=["native", "torch"])
def native(request):
    """Both CPU paths: the C kernel for decode rows, and index_select + SDPA."""
    return request.param


def _run_case(
    q_lens, seq_lens, spec, slot_overrides=None, seed=0, dtype=torch.float32, native=True
):
    """Pre-fill each request's earlier context into the cache, run one step, compare."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for s in seq_lens:
        n = -(-s // BLOCK)
        tables.append([perm.pop() for _ in range(n)])
    cache = torch.zeros(num_blocks, 2, BLOCK, HKV, D, dtype=dtype)
    ks = [torch.randn(s, HKV, D, generator=gen).to(dtype) for s in seq_lens]
    vs = [torch.randn(s, HKV, D, generator=gen).to(dtype) for s in seq_lens]
    qs = [torch.randn(n, H, D, generator=gen).to(dtype) for n in q_lens]
    for k, v, n, s, table in zip(ks, vs, q_lens, seq_lens, tables, strict=True):
        for p in range(s - n):  # context computed by earlier steps
            cache[table[p // BLOCK], 0, p % BLOCK] = k[p]
            cache[table[p // BLOCK], 1, p % BLOCK] = v[p]
    md = build_metadata(q_lens, seq_lens, tables, BLOCK, slot_overrides=slot_overrides)
    k_new = torch.cat([k[s - n :] for k, n, s in zip(ks, q_lens, seq_lens, strict=True)])
    v_new = torch.cat([v[s - n :] for v, n, s in zip(vs, q_lens, seq_lens, strict=True)])
    before = cache.clone()
    backend = TorchPagedBackend(native=native)
    backend.begin_step(md)
    out = backend.forward(torch.cat(qs), k_new, v_new, cache, md, spec)
    return out, (qs, ks, vs, tables, cache, before, md)


@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [
        ([1, 1, 1, 1], [1, 5, 9, 16]),  # decode only
        ([7, 1, 3, 1], [7, 12, 10, 1]),  # mixed prefill / chunk / decode
        ([13], [13]),  # single prefill
    ],
)
def test_matches_naive_reference(q_lens, seq_lens, native):
    spec = _spec()
    out, (qs, ks, vs, *_rest) = _run_case(q_lens, seq_lens, spec, native=native)
    ref = torch.cat(
        [_reference(q, k, v, s, spec) for q, k, v, s in zip(qs, ks, vs, seq_lens, strict=True)]
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_sliding_window_sees_only_last_window_keys(window, native):
    q_lens, seq_lens = [9, 1, 4], [9, 14, 11]
    spec = _spec(window=window)
    out, (qs, ks, vs, *_rest) = _run_case(q_lens, seq_lens, spec, seed=1, native=native)
    ref = torch.cat(
        [_reference(q, k, v, s, spec) for q, k, v, s in zip(qs, ks, vs, seq_lens, strict=True)]
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_logits_soft_cap_applied(native):
    q_lens, seq_lens = [5, 1], [5, 8]
    spec = _spec(cap=0.5)
    out, (qs, ks, vs, *_rest) = _run_case(q_lens, seq_lens, spec, seed=2, native=native)
    ref = torch.cat(
        [_reference(q, k, v, s, spec) for q, k, v, s in zip(qs, ks, vs, seq_lens, strict=True)]
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_new_kv_written_to_their_slots_and_minus_one_skipped(native):
    q_lens, seq_lens = [3, 1], [3, 6]
    # Token 1 (request 0, position 1) gets slot -1: nothing may be written for it.
    out, (qs, ks, vs, tables, cache, before, md) = _run_case(
        q_lens, seq_lens, _spec(), slot_overrides={1: -1}, seed=3, native=native
    )
    expected = before.clone()
    for r, (n, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for p in range(s - n, s):
            if r == 0 and p == 1:
                continue
            expected[tables[r][p // BLOCK], 0, p % BLOCK] = ks[r][p]
            expected[tables[r][p // BLOCK], 1, p % BLOCK] = vs[r][p]
    assert torch.equal(cache, expected)
    # Request 1 never looks at request 0's slots, so it is unaffected.
    ref1 = _reference(qs[1], ks[1], vs[1], seq_lens[1], _spec())
    torch.testing.assert_close(out[3:], ref1, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float32_reference():
    q_lens, seq_lens = [6, 1], [6, 10]
    spec = _spec()
    out, (qs, ks, vs, *_rest) = _run_case(q_lens, seq_lens, spec, seed=4, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    ref = torch.cat(
        [
            _reference(q.float(), k.float(), v.float(), s, spec)
            for q, k, v, s in zip(qs, ks, vs, seq_lens, strict=True)
        ]
    )
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_plan_rebuilt_when_metadata_object_is_reused_with_new_lengths(native):
    """A runner may mutate one metadata object in place; the backend must not reuse a plan."""
    spec = _spec()
    out1, (qs, ks, vs, tables, cache, _before, md) = _run_case([4], [4], spec, seed=5)
    backend = TorchPagedBackend(native=native)
    backend.forward(qs[0], ks[0], vs[0], cache, md, spec)
    md2 = build_metadata([1], [5], [tables[0] + [63]], BLOCK)
    q, k, v = torch.randn(1, H, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    md.__dict__.update(md2.__dict__)  # same object, new contents
    out = backend.forward(q, k, v, cache, md, spec)
    ref = _reference(q, torch.cat([ks[0], k]), torch.cat([vs[0], v]), 5, spec)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
