"""bf16 rows as int16 planes (csrc/quant_linear_q4g.c, Q4G_BF16_I16, the Intel default): the
planes hold every value exactly when it lies within 15 binades of its block's largest, the
rest within 2^-23 of that largest; the q4 kernel on them equals the widened fp32 kernel to
bf16's resolution and is exact where the fp32 sums are; infinities and NaNs widen."""

from __future__ import annotations

import pytest
import torch

from engine.worker.kernels import quant as qkernels
from engine.worker.quant.blocks import (
    Q4G,
    dequantize,
    pack_q4,
    quantize_q4,
    to_column_groups,
)

I16, WIDEN = 2, 0


def _lib():
    lib = qkernels.library()
    if lib is None:
        pytest.skip("no C compiler")
    return lib


@pytest.fixture
def i16_mode():
    """The int16 path switched on for the test (where this build has it), restored after."""
    lib = _lib()
    before = lib.q4g_bf16_native()
    lib.q4g_use_bf16_dot(I16)
    if lib.q4g_bf16_native() != I16:
        lib.q4g_use_bf16_dot(before)
        pytest.skip("this build has no int16 path (needs AVX512-VNNI)")
    yield lib
    lib.q4g_use_bf16_dot(before)


def _planes(lib, x: torch.Tensor):
    """q4g_i16_prep on bf16 rows [M, K]: (ok, plane 1, plane 2, scales [M, nb, 2], two)."""
    m, k = x.shape
    nb = k // 32
    p = torch.zeros(2, m, k, dtype=torch.int16)
    sc = torch.zeros(m, nb, 2)
    two = torch.zeros(m, nb, dtype=torch.uint8)
    ok = lib.q4g_i16_prep(
        x.data_ptr(), x.stride(0), m, nb, p[0].data_ptr(), p[1].data_ptr(), sc.data_ptr(),
        two.data_ptr(),
    )  # fmt: skip
    return ok, p[0], p[1], sc, two


def _value(p1, p2, sc, k):
    """What the planes say each value is (float64: exact)."""
    s1 = sc[..., 0].double().repeat_interleave(32, -1)[..., :k]
    s2 = sc[..., 1].double().repeat_interleave(32, -1)[..., :k]
    return p1.double() * s1 + p2.double() * s2


def test_planes_are_exact_within_15_binades_and_close_below(i16_mode):
    torch.manual_seed(0)
    x = (torch.randn(4, 128) * torch.logspace(-6, 2, 128)).bfloat16()  # spreads of all sizes
    x[0, 5], x[1, 40], x[2, 100] = 0.0, -0.0, 2.0**-130  # zeros, a subnormal
    x[3, 96:128] = torch.tensor([2.0**-e for e in range(32)], dtype=torch.bfloat16)
    ok, p1, p2, sc, two = _planes(i16_mode, x)
    assert ok == 1
    got, want = _value(p1, p2, sc, 128), x.double()
    blocks = want.abs().reshape(4, 4, 32)
    largest = blocks.amax(-1, keepdim=True).expand(-1, -1, 32).reshape(4, 128)
    near = want.abs() >= largest * 2.0**-15  # within 15 binades of its block's largest
    assert torch.equal(got[near], want[near])
    assert ((got - want).abs() <= largest * 2.0**-23).all()
    assert two[3, 3] == 1  # 2^0 .. 2^-31 in one block: the second plane is used
    assert (p1.abs().max() <= 255 << 7) and (p2.abs().max() <= 255 << 7)


def test_zero_blocks_and_a_single_value(i16_mode):
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 40] = -3.5
    ok, p1, p2, sc, two = _planes(i16_mode, x)
    assert ok == 1 and two.sum() == 0
    assert torch.equal(_value(p1, p2, sc, 64), x.double())


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_infinities_and_nans_have_no_plane(i16_mode, bad):
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    x[1, 33] = bad
    assert _planes(i16_mode, x)[0] == 0


def _linear(lib, mode, x, g, k, bias, n):
    lib.q4g_use_bf16_dot(mode)
    return qkernels.linear_bf16(x, g, Q4G, k, bias, rows=n)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 17])
def test_the_kernel_on_planes_matches_the_widened_one(i16_mode, m):
    torch.manual_seed(m)
    n, k = 75, 192  # a partial column group; 6 blocks
    t = quantize_q4(torch.randn(n, k) * 0.1)
    g = to_column_groups(t)
    x = torch.randn(m, k)
    x[:, 64:96] *= 1e-5  # a block far below the others
    x[0, 10] = 3e-7  # a value 20+ binades below its block's largest
    xb = x.bfloat16()
    bias = torch.randn(n)
    exact = xb.double() @ dequantize(t).double().t() + bias.double()
    planes = _linear(i16_mode, I16, xb, g, k, bias, n)
    widened = _linear(i16_mode, WIDEN, xb, g, k, bias, n)
    i16_mode.q4g_use_bf16_dot(I16)
    # both are the exact product rounded to bf16, up to fp32 sums' differences
    torch.testing.assert_close(planes.double(), exact, atol=1e-5, rtol=2**-8)
    assert (planes != widened).float().mean() < 0.01


def test_small_integer_rows_are_exact(i16_mode):
    """Rows and weights whose products sum exactly in any order: the planes' path gives the
    exact result rounded once (no second rounding anywhere but the final bf16)."""
    n, k = 32, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    t = pack_q4(q, torch.full((n, k // 32), 1.0), torch.full((n, k // 32), -8.0))
    x = torch.randint(-4, 5, (3, k)).bfloat16()
    exact = x.double() @ dequantize(t).double().t()
    y = _linear(i16_mode, I16, x, to_column_groups(t), k, None, n)
    i16_mode.q4g_use_bf16_dot(I16)
    assert torch.equal(y, exact.to(torch.bfloat16))


def test_an_infinity_in_the_rows_takes_the_widened_path(i16_mode):
    t = quantize_q4(torch.randn(32, 64))
    g = to_column_groups(t)
    x = torch.randn(2, 64).bfloat16()
    x[0, 1] = float("inf")
    planes = _linear(i16_mode, I16, x, g, 64, None, 32)
    widened = _linear(i16_mode, WIDEN, x, g, 64, None, 32)
    i16_mode.q4g_use_bf16_dot(I16)
    assert torch.equal(planes.isnan(), widened.isnan())
    assert torch.equal(planes[1], widened[1])  # the other row: the same widened sums
