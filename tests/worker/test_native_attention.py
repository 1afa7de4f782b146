"""The C paged-attention kernel (engine/worker/kernels/attention.py) against a per-query reference.

Covers what the shared backend tests do not: the head dims the kernel specializes (64, 128)
and the generic one, grouped-query ratios, real block sizes, bf16 caches, windows that cut
blocks in half, the per-head task split (few rows) and the per-row split (many), rows picked
out of a larger q, and the switches that turn it off.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

from engine.worker.kernels import attention as native
from tests.support.waiting import HANG_S

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


def _reference(q, k_ctx, v_ctx, pos, scale, window):
    """q [H, D] at position pos over k_ctx/v_ctx [S, Hkv, D] (positions 0..S-1)."""
    H, Hkv = q.shape[0], k_ctx.shape[1]
    lo = 0 if window is None else max(0, pos - window + 1)
    out = torch.empty_like(q)
    for h in range(H):
        keys, vals = k_ctx[lo : pos + 1, h // (H // Hkv)], v_ctx[lo : pos + 1, h // (H // Hkv)]
        out[h] = torch.softmax((keys @ q[h]) * scale, dim=0) @ vals
    return out


def _case(
    seq_lens, H, Hkv, D, block, dtype=torch.float32, window=None, seed=0, spare_rows=0,
    q_dtype=torch.float32,
):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-s // block) for s in seq_lens) + 3
    perm = torch.randperm(nblocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-s // block))] for s in seq_lens]
    width = max(len(t) for t in tables) + 2
    bt = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    cache = torch.randn(nblocks, 2, block, Hkv, D, generator=gen).to(dtype)
    ks, vs = [], []
    for r, (s, t) in enumerate(zip(seq_lens, tables, strict=True)):
        bt[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
        idx = torch.tensor([t[p // block] for p in range(s)])
        off = torch.tensor([p % block for p in range(s)])
        ks.append(cache[idx, 0, off].float())
        vs.append(cache[idx, 1, off].float())
    # q has spare rows the kernel must not touch; rows are taken in a shuffled order.
    n = len(seq_lens)
    q = torch.randn(n + spare_rows, H, D, generator=gen).to(q_dtype)
    rows = torch.randperm(n + spare_rows, generator=gen)[:n].long()
    reqs = torch.arange(n, dtype=torch.long)
    pos = torch.tensor([s - 1 for s in seq_lens], dtype=torch.long)
    out = torch.full_like(q, 7.0)
    native.paged_attention(q, cache, bt, rows, reqs, pos, out, 1 / math.sqrt(D), window)
    for i in range(n):
        q_i = q[rows[i]].float()
        ref = _reference(q_i, ks[i], vs[i], seq_lens[i] - 1, 1 / math.sqrt(D), window)
        tol = 1e-5 if dtype == torch.float32 and q_dtype == torch.float32 else 2e-3
        if q_dtype == torch.bfloat16:  # fp32 inside, one rounding of the result
            ref, tol = ref.to(q_dtype).float(), 8e-3
        torch.testing.assert_close(out[rows[i]].float(), ref, atol=tol, rtol=tol)
    untouched = torch.ones(n + spare_rows, dtype=torch.bool)
    untouched[rows] = False
    assert torch.all(out[untouched] == 7.0)


@pytest.mark.parametrize("D", [64, 128, 40])
@pytest.mark.parametrize("H,Hkv", [(8, 8), (8, 2), (12, 4), (96, 8)])  # 96 x 128 > MAX_ACC
def test_head_dims_and_groups(D, H, Hkv):
    _case([1, 17, 33, 70], H, Hkv, D, block=16, seed=D + H)


@pytest.mark.parametrize("num_rows", [1, 3, 40])  # per-head split below 4 rows a thread
def test_few_and_many_rows(num_rows):
    lens = [(7 * i) % 90 + 1 for i in range(num_rows)]
    _case(lens, 8, 4, 64, block=16, seed=num_rows, spare_rows=5)


@pytest.mark.parametrize("window", [1, 5, 16, 23, 1000])
def test_sliding_windows_cut_blocks(window):
    _case([1, 9, 40, 64], 4, 2, 64, block=8, window=window, seed=window)


@pytest.mark.parametrize("block", [1, 4, 32, 64])
def test_block_sizes(block):
    _case([1, 5, 31, 32, 33], 4, 1, 64, block=block, seed=block)


def test_bf16_cache():
    _case([1, 15, 48], 8, 2, 64, block=16, dtype=torch.bfloat16, seed=9)


@pytest.mark.parametrize("num_rows", [1, 40])
def test_bf16_queries_and_output(num_rows):
    """The bf16 model's path: q, out and the cache in bf16, fp32 inside."""
    seq_lens = [3 + 17 * i % 90 for i in range(num_rows)]
    _case(seq_lens, 8, 2, 64, block=16, dtype=torch.bfloat16, seed=11, spare_rows=2,
          q_dtype=torch.bfloat16)  # fmt: skip


@pytest.mark.parametrize(
    "D,H,Hkv,block,window",
    [(64, 8, 8, 16, None), (128, 12, 4, 32, 23), (128, 8, 1, 64, None), (256, 4, 2, 4, 9),
     (96, 6, 2, 16, None), (80, 6, 2, 16, None), (64, 6, 2, 1, 5)],
)  # fmt: skip
def test_bf16_dot_path_shapes(D, H, Hkv, block, window):
    """With AVX512-BF16 a bf16 cache and bf16 queries with D a multiple of 32 take
    VDPBF16PS scores, 16-token reduction trees and values widened in even/odd halves (put
    back in order at the end; csrc/paged_attention.c): head dims, groups (odd ones too),
    blocks shorter and longer than 16 tokens, windows that start mid-block. D = 80 is no
    multiple of 32: the scalar path, beside it. Without the instructions every case runs
    the scalar path."""
    lens = [1, 15, 16, 17, 31, 47, 70]
    _case(lens, H, Hkv, D, block=block, dtype=torch.bfloat16, window=window, seed=D + block,
          spare_rows=1, q_dtype=torch.bfloat16)  # fmt: skip


def test_long_context_online_softmax_is_stable():
    """Scores that grow along the sequence make the running max move every block."""
    gen = torch.Generator().manual_seed(3)
    H = Hkv = 1
    D, block, S = 64, 16, 600
    cache = torch.zeros(S // block + 1, 2, block, Hkv, D)
    keys = torch.randn(S, D, generator=gen) * torch.linspace(0.1, 6.0, S)[:, None]
    vals = torch.randn(S, D, generator=gen)
    for p in range(S):
        cache[p // block, 0, p % block, 0] = keys[p]
        cache[p // block, 1, p % block, 0] = vals[p]
    bt = torch.arange(S // block + 1, dtype=torch.int32)[None]
    q = torch.randn(1, H, D, generator=gen) * 3
    out = torch.empty_like(q)
    zero = torch.zeros(1, dtype=torch.long)
    native.paged_attention(q, cache, bt, zero, zero, torch.tensor([S - 1]), out, 0.125, None)
    ref = torch.softmax(keys @ q[0, 0] * 0.125, dim=0) @ vals
    torch.testing.assert_close(out[0, 0], ref, atol=1e-5, rtol=1e-5)


def test_supports_refuses_what_the_kernel_cannot_read():
    q = torch.zeros(2, 8, 64)
    cache = torch.zeros(4, 2, 16, 2, 64)
    assert native.supports(q, cache, 8, 2)
    assert not native.supports(q.half(), cache, 8, 2)
    assert not native.supports(q, cache.half(), 8, 2)
    assert not native.supports(q, torch.zeros(4, 2, 128, 2, 64), 8, 2)  # block > 64
    assert not native.supports(q, cache, 8, 3)  # heads not a multiple of kv heads


def test_off_switch_falls_back_to_torch_with_the_same_answer(tmp_path):
    """APPLIANCE_CPU_KERNELS=off: nothing is built, the backend uses SDPA, results agree."""
    code = (
        "import torch, math\n"
        "from engine.worker.kernels import attention as native\n"
        "from engine.worker.attention.torch_paged import TorchPagedBackend\n"
        "from engine.worker.attention.base import AttentionLayerSpec\n"
        "from tests.support.paged_harness import build_metadata\n"
        "assert native.library() is None\n"
        "torch.manual_seed(0)\n"
        "cache = torch.randn(8, 2, 4, 2, 16)\n"
        "md = build_metadata([1, 1], [5, 9], [[3, 1], [0, 2, 5]], 4)\n"
        "spec = AttentionLayerSpec(4, 2, 16, 0.25)\n"
        "q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)\n"
        "out = TorchPagedBackend().forward(q, k, v, cache, md, spec)\n"
        f"torch.save(out, {str(tmp_path / 'off.pt')!r})\n"
    )
    env = dict(os.environ, APPLIANCE_CPU_KERNELS="off", APPLIANCE_KERNEL_CACHE=str(tmp_path / "k"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], env=env, cwd=root, check=True, timeout=HANG_S)
    assert not (tmp_path / "k").exists()

    from engine.worker.attention.base import AttentionLayerSpec
    from engine.worker.attention.torch_paged import TorchPagedBackend
    from tests.support.paged_harness import build_metadata

    torch.manual_seed(0)
    cache = torch.randn(8, 2, 4, 2, 16)
    md = build_metadata([1, 1], [5, 9], [[3, 1], [0, 2, 5]], 4)
    spec = AttentionLayerSpec(4, 2, 16, 0.25)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    out = TorchPagedBackend(native=True).forward(q, k, v, cache, md, spec)
    torch.testing.assert_close(out, torch.load(tmp_path / "off.pt"), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISA levels")
def test_the_avx2_build_takes_the_portable_loops_with_the_same_answers(tmp_path):
    """AVX-512 boxes run the explicit vector loops (csrc/vec512.h: attention over fp32 and
    bf16 caches, the vector softmax, the spread prefetch, SiLU-and-mul and RMSNorm); an AVX2
    build of the same library runs the portable loops. Both must pass the same reference
    checks, whatever CPU runs the suite: the library built with -march=x86-64-v3 in a
    subprocess (its own kernel cache)."""
    code = (
        "import torch\n"
        "from tests.worker import test_native_attention as t\n"
        "for D, H, Hkv in [(64, 8, 2), (128, 12, 4), (40, 6, 2)]:\n"
        "    t._case([1, 15, 17, 47, 70] * 2, H, Hkv, D, block=16, seed=D)\n"
        "    t._case([1, 15, 17, 47, 70] * 2, H, Hkv, D, block=16, dtype=torch.bfloat16,\n"
        "            q_dtype=torch.bfloat16, window=23, seed=D)\n"
        "from tests.worker import test_fused_ops as f\n"
        "f.test_bf16_ops_equal_the_torch_bf16_ops_bit_for_bit(5)\n"
        "f.test_silu_and_mul_matches_torch(7)\n"
    )
    env = dict(os.environ, APPLIANCE_KERNEL_MARCH="x86-64-v3",
               APPLIANCE_KERNEL_CACHE=str(tmp_path / "k"))  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                          text=True, timeout=HANG_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "k").glob("appliance_kernels-*.so"))  # it built its own


def test_kernel_builds_into_its_cache_dir(tmp_path):
    env = dict(os.environ, APPLIANCE_KERNEL_CACHE=str(tmp_path))
    code = "import torch\nfrom engine.worker.kernels import attention as native\nassert native.library() is not None\n"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], env=env, cwd=root, check=True, timeout=HANG_S)
    built = list(tmp_path.glob("appliance_kernels-*.so"))
    assert len(built) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_the_torch_scatter_and_skips_padding(dtype):
    from engine.worker.attention.torch_paged import TorchPagedBackend

    gen = torch.Generator().manual_seed(3)
    T, Hkv, D, block = 70, 2, 16, 4  # 70 tokens: the parallel loop runs
    qkv = torch.randn(T, (4 + 2 * Hkv) * D, generator=gen).to(dtype)
    k = qkv[:, 4 * D : (4 + Hkv) * D].view(T, Hkv, D)  # strided views, as the model passes
    v = qkv[:, (4 + Hkv) * D :].view(T, Hkv, D)
    slots = torch.randperm(30 * block, generator=gen)[:T].long()
    slots[::7] = -1  # padding tokens store nothing
    expected = torch.randn(30, 2, block, Hkv, D, generator=gen).to(dtype)
    got = expected.clone()
    TorchPagedBackend.write_kv(k, v, expected, slots)
    assert native.can_write_kv(k, v, got)
    native.write_kv(k, v, got, slots)
    assert torch.equal(got, expected)
    assert not native.can_write_kv(k.float() if dtype != torch.float32 else k.bfloat16(), v, got)
