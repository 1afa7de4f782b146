"""The q4/q8 block formats and the block linear: exact layouts, the kernel equal to the
dequantized product on both sides of the row-count rule, slicing at block boundaries; the
q4 column-group layout and its fp32 and bf16 kernels (on this CPU's ISA, and built for AVX2
and for plain C in a subprocess)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from engine.worker.kernels import quant as qkernels
from engine.worker.quant import linear as qlinear
from engine.worker.quant.blocks import (
    Q4,
    Q4G,
    Q8,
    BlockTensor,
    dequantize,
    from_column_groups,
    pack_q4,
    quantize_q4,
    quantize_q8,
    round_activations_int8,
    to_column_groups,
)
from engine.worker.quant.linear import QuantLinear

needs_kernels = pytest.mark.skipif(not qkernels.available(), reason="no C compiler")


def _w(n=48, k=96, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_q4_block_bytes_follow_ggufs_q4_1_layout():
    q = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    t = pack_q4(q, torch.tensor([[0.5]]), torch.tensor([[-1.0]]))
    raw = t.data[0]
    assert raw.numel() == 20
    assert raw[0:2].view(torch.float16).item() == 0.5 and raw[2:4].view(torch.float16).item() == -1
    assert raw[4].item() == (0 | (0 << 4)) and raw[5].item() == (1 | (1 << 4))  # w0|w16, w1|w17
    assert dequantize(t)[0].tolist() == [0.5 * (i % 16) - 1.0 for i in range(32)]


def test_quantizers_stay_within_half_a_step():
    w = _w()
    for t, step in ((quantize_q8(w), w.abs().amax() / 127), (quantize_q4(w), None)):
        err = (dequantize(t) - w).abs()
        if step is None:  # q4: half of each group's (max - min) / 15
            g = w.view(48, 3, 32)
            step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, 1)
        assert bool((err <= step / 2 * 1.01 + 1e-4).all())


def test_int4_group_wider_than_a_block_shares_its_scale():
    t = quantize_q4(_w(k=128), group=64)
    b = t.data.view(48, 4, 20)
    assert torch.equal(b[:, 0, :4], b[:, 1, :4]) and torch.equal(b[:, 2, :4], b[:, 3, :4])


def _weight_data(t: BlockTensor, kind: int) -> torch.Tensor:
    return to_column_groups(t) if kind == Q4G else t.data


def test_column_groups_hold_the_same_bytes_in_groups_of_16_columns():
    t = quantize_q4(_w(n=40, k=96))  # 40 = 2 groups + 8 columns padded with zeros
    g = to_column_groups(t)
    assert g.shape == (3, 3 * 320)
    back = from_column_groups(g, 40, 96)
    assert torch.equal(back.data, t.data)
    blocks = t.data.view(40, 3, 20)
    first = g.view(3, 3, 320)[0, 1]  # group 0, block 1
    assert torch.equal(first[0:32].view(16, 2), blocks[:16, 1, 0:2])  # the 16 columns' d
    assert torch.equal(first[32:64].view(16, 2), blocks[:16, 1, 2:4])  # ... and m
    q = torch.cat([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], -1)  # [40, 3, 32]
    col, k = 5, 8  # chunk 2, column 5: q[8] | q[10] << 4, q[9] | q[11] << 4
    pair = first[64 + 2 * 32 + 2 * col : 64 + 2 * 32 + 2 * col + 2]
    assert pair.tolist() == [
        int(q[col, 1, k] | q[col, 1, k + 2] << 4),
        int(q[col, 1, k + 1] | q[col, 1, k + 3] << 4),
    ]
    assert bool((g.view(3, 3, 320)[2, :, :32].view(3, 16, 2)[:, 8:] == 0).all())  # padding


@needs_kernels
@pytest.mark.parametrize("kind", [Q4, Q4G, Q8])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_block_kernel_equals_the_dequantized_product(kind, rows):
    w = _w(n=40, k=96)
    t = quantize_q8(w) if kind == Q8 else quantize_q4(w)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(40)
    y = qkernels.linear(x, _weight_data(t, kind), kind, 96, bias, rows=40)
    expected = x.double() @ dequantize(t).double().t() + bias.double()
    torch.testing.assert_close(y.double(), expected, atol=2e-6, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("kind", [Q4, Q4G, Q8])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_bf16_rows_get_the_exact_product_rounded_once(kind, rows):
    """bf16 in, bf16 out: the dequantized weights times the bf16 rows plus the bias, in fp32
    (exact products, fp32 sums), rounded to bf16 once: within one bf16 rounding of the fp64
    value. The bias is fp32 (not rounded to bf16 first)."""
    w = _w(n=40, k=96)
    t = quantize_q8(w) if kind == Q8 else quantize_q4(w)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(40)
    y = qkernels.linear_bf16(x, _weight_data(t, kind), kind, 96, bias, rows=40)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 40)
    exact = x.double() @ dequantize(t).double().t() + bias.double()
    # one rounding to bf16 (2^-9 relative) plus fp32 summation error
    torch.testing.assert_close(y.double(), exact, atol=1e-5, rtol=2**-8)
    assert float((y.double() - exact.bfloat16().double()).abs().gt(1e-6).float().mean()) < 0.05


@needs_kernels
def test_column_group_kernels_on_every_shape_edge():
    """Columns not a multiple of 16, one block, many blocks, rows past the 4-row tile."""
    for n, k, rows in ((1, 32, 1), (17, 64, 6), (33, 320, 13), (64, 1536, 2)):
        t = quantize_q4(_w(n=n, k=k, seed=n))
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
        g = to_column_groups(t)
        exact = x.double() @ dequantize(t).double().t()
        y = qkernels.linear(x, g, Q4G, k, None, rows=n)
        torch.testing.assert_close(y.double(), exact, atol=5e-6, rtol=1e-5)
        yb = qkernels.linear_bf16(x.bfloat16(), g, Q4G, k, None, rows=n)
        exact_b = x.bfloat16().double() @ dequantize(t).double().t()
        torch.testing.assert_close(yb.double(), exact_b, atol=1e-5, rtol=2**-8)
        out = qkernels.dequantize_into(g, Q4G, k, torch.empty(n, k))
        torch.testing.assert_close(out, dequantize(t), atol=0, rtol=1e-6)
        out_t = qkernels.dequantize_t_into(g, k, torch.empty(k, n))
        torch.testing.assert_close(out_t.t(), dequantize(t), atol=0, rtol=1e-6)
        out_tb = qkernels.dequantize_t_into(g, k, torch.empty(k, n, dtype=torch.bfloat16))
        torch.testing.assert_close(out_tb.t().float(), dequantize(t, torch.bfloat16).float(),
                                   atol=0, rtol=2**-8)  # fmt: skip


@needs_kernels
def test_the_transposed_bf16_copy_is_the_fp32_copy_rounded_bit_for_bit():
    """The large-batch path's bf16 copy rounds 16 lanes at a time (vec512.h's to_bf16x16):
    the same bits as torch rounding the fp32 copy, on exact ties (1 + 2^-8 lies halfway
    between two bf16 values), a NaN scale and a partial last group."""
    n, k = 21, 96  # 21 columns: a group of 16 and a partial one
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).to(torch.float16).float()
    m = (torch.randn(n, k // 32, generator=g) * 0.1).to(torch.float16).float()
    d[0, :], m[0, :] = 0.0, 1.00390625  # every weight of column 0 a tie: rounds to even 1.0
    d[1, 0], m[1, 1] = 2.0**-8, 1.0  # 1 + q 2^-8: ties at odd q
    d[2, 1], m[3, 2] = float("nan"), float("-inf")
    groups = to_column_groups(pack_q4(q, d, m))
    f32 = qkernels.dequantize_t_into(groups, k, torch.empty(k, n))
    b16 = qkernels.dequantize_t_into(groups, k, torch.empty(k, n, dtype=torch.bfloat16))
    nan = torch.isnan(f32)
    assert nan[32:64, 2].all() and nan.sum() == 32
    bits = b16.view(torch.int16)
    expected = f32.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(bits[~nan], expected[~nan])
    assert (bits[nan] == 0x7FC0).all()  # bf16.h's quiet NaN (torch's own may differ)
    assert b16[0, 0].item() == 1.0 and torch.isinf(b16[64:, 3]).all()


@needs_kernels
@pytest.mark.parametrize("kernel", ["dot", "rounded"])
@pytest.mark.parametrize("kind", [Q4, Q8])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_int8_activation_kernels_are_the_weights_times_the_rounded_rows(kernel, kind, rows):
    """Both int8-activation kernels (integer dot products; rounded rows through the fp32
    kernel) compute the dequantized weights times the activations rounded to int8 per 32
    values (`round_activations_int8`, the dense path's rounding), at any row count."""
    w = _w(n=40, k=96)
    t = quantize_q4(w) if kind == Q4 else quantize_q8(w)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(40)
    y = qkernels.linear(x, t.data, kind, 96, bias, int8_activations=kernel)
    wd = dequantize(t).double()
    expected = round_activations_int8(x).double() @ wd.t() + bias.double()
    torch.testing.assert_close(y.double(), expected, atol=2e-6, rtol=1e-5)
    exact = x.double() @ wd.t() + bias.double()
    assert float((y.double() - exact).abs().max()) > 1e-5  # it is not the fp32 path


@pytest.mark.parametrize("rows", [1, qlinear.DENSE_ROWS - 1, qlinear.DENSE_ROWS, 70])
def test_int8_activations_give_one_answer_on_both_sides_of_the_row_rule(rows):
    w, bias = _w(n=64, k=96), torch.randn(64)
    layer = _layer(w, Q4, bias, int8=True)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(2))
    wd = dequantize(layer.blocks()).double()
    expected = round_activations_int8(x).double() @ wd.t() + bias.double()
    torch.testing.assert_close(layer(x).double(), expected, atol=2e-5, rtol=1e-4)


def _layer(w, kind, bias=None, shard_sizes=None, int8=False):
    n, k = w.shape
    layer = QuantLinear(k, n, bias is not None, target=kind, shard_sizes=shard_sizes)
    layer.int8_activations = int8
    if shard_sizes is None:
        layer.load_tensor("weight", None, w)
        if bias is not None:
            layer.load_tensor("bias", None, bias)
    layer.finalize()
    return layer


def test_q4_layers_keep_column_groups_only_where_a_kernel_reads_them():
    layer = _layer(_w(n=40, k=96), Q4)
    assert layer.kind == (Q4G if qkernels.available() else Q4)
    assert torch.equal(layer.blocks().data, quantize_q4(_w(n=40, k=96)).data)
    assert _layer(_w(n=40, k=96), Q4, int8=True).kind == Q4  # the int8 kernel reads GGUF's
    assert _layer(_w(n=40, k=96), Q8).kind == Q8


@pytest.mark.parametrize(
    "rows",
    [1, qlinear.DENSE_ROWS - 1, qlinear.DENSE_ROWS, qlinear.DENSE_ROWS_FP32 - 1,
     qlinear.DENSE_ROWS_FP32, 70],
)  # fmt: skip
def test_quant_linear_gives_one_answer_on_both_sides_of_the_row_rule(rows):
    w, bias = _w(n=64, k=96), torch.randn(64)
    layer = _layer(w, Q4, bias)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(2))
    expected = x.double() @ dequantize(layer.blocks()).double().t()
    torch.testing.assert_close(layer(x).double(), expected + bias.double(), atol=2e-5, rtol=1e-4)
    bf = layer(x.bfloat16())
    assert bf.dtype == torch.bfloat16 and bf.shape == (rows, 64)
    expected_bf = x.bfloat16().double() @ dequantize(layer.blocks()).double().t()
    torch.testing.assert_close(bf.double(), expected_bf + bias.double(), atol=3e-2, rtol=1e-2)


def test_fused_shards_join_in_order_and_a_missing_one_is_refused():
    q, k = _w(n=32, seed=3), _w(n=16, seed=4)
    layer = QuantLinear(96, 48, False, target=Q8, shard_sizes={"q": 32, "k": 16})
    layer.load_tensor("weight", "k", k)
    layer.load_tensor("weight", "q", q)
    layer.finalize()
    torch.testing.assert_close(
        dequantize(layer.blocks()),
        torch.cat([dequantize(quantize_q8(q)), dequantize(quantize_q8(k))]),
    )
    incomplete = QuantLinear(96, 48, False, target=Q8, shard_sizes={"q": 32, "k": 16})
    incomplete.load_tensor("weight", "q", q)
    with pytest.raises(ValueError, match="missing k"):
        incomplete.finalize()


def test_columns_slice_only_at_block_boundaries():
    t = quantize_q8(_w(k=128))
    half = t.narrow(1, 64, 128, 64)
    torch.testing.assert_close(dequantize(half), dequantize(t)[:, 64:])
    with pytest.raises(ValueError, match="do not fall on"):
        t.narrow(1, 48, 96, 48)
    padded = t.narrow(0, 40, 56, 16)  # past the last row: zero rows
    assert padded.rows == 16 and bool((dequantize(padded)[8:] == 0).all())


@needs_kernels
@pytest.mark.parametrize("kind", [Q4, Q4G, Q8])
def test_the_bf16_copy_is_the_blocks_rounded_to_bf16(kind):
    w = _w(n=40, k=96)
    t = quantize_q8(w) if kind == Q8 else quantize_q4(w)
    out = torch.empty(40, 96, dtype=torch.bfloat16)
    out = qkernels.dequantize_into(_weight_data(t, kind), kind, 96, out)
    ref = dequantize(t, torch.bfloat16)
    # the same fp32 value rounded to nearest even (an FMA in d q + m may move one ulp)
    torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=2**-8)


def test_the_row_rule_depends_on_the_activations():
    assert qlinear.dense_rows(torch.bfloat16) == qlinear.DENSE_ROWS == 32
    assert qlinear.dense_rows(torch.float32) == qlinear.DENSE_ROWS_FP32 == 64
    assert qlinear.dense_rows(torch.float32, int8_activations=True) == 32


@needs_kernels
def test_bf16_activations_at_many_rows_run_the_bf16_gemm_on_the_bf16_copy():
    w, bias = _w(n=64, k=96), torch.randn(64)
    layer = _layer(w, Q4, bias)
    x = torch.randn(qlinear.DENSE_ROWS + 6, 96, generator=torch.Generator().manual_seed(3))
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16
    wd = dequantize(layer.blocks(), torch.bfloat16).double()
    expected = x.bfloat16().double() @ wd.t() + bias.bfloat16().double()
    torch.testing.assert_close(y.double(), expected, atol=3e-2, rtol=1e-2)


_ISA_CHECK = """
import torch
from engine.worker.kernels import quant as qk
from engine.worker.quant.blocks import Q4G, dequantize, quantize_q4, to_column_groups
assert qk.available()
for n, k, rows in ((40, 96, 1), (17, 64, 6), (48, 1536, 5)):
    t = quantize_q4(torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(n)
    exact = x.double() @ dequantize(t).double().t() + bias.double()
    y = qk.linear(x, to_column_groups(t), Q4G, k, bias, rows=n)
    torch.testing.assert_close(y.double(), exact, atol=5e-6, rtol=1e-5)
    yb = qk.linear_bf16(x.bfloat16(), to_column_groups(t), Q4G, k, bias, rows=n)
    exact_b = x.bfloat16().double() @ dequantize(t).double().t() + bias.double()
    torch.testing.assert_close(yb.double(), exact_b, atol=1e-5, rtol=2**-8)
    wt = qk.dequantize_t_into(to_column_groups(t), k, torch.empty(k, n))
    torch.testing.assert_close(wt.t(), dequantize(t), atol=0, rtol=1e-6)
print("native bf16", qk.bf16_native())
"""


@needs_kernels
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISA levels")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_column_group_kernels_built_for_avx2_and_for_plain_c(march, tmp_path):
    """The AVX2 and plain C paths of csrc/quant_linear_q4g.c, whatever this CPU has: the
    library built with -march=<level> in a subprocess (its own kernel cache)."""
    env = dict(os.environ, APPLIANCE_KERNEL_MARCH=march, APPLIANCE_KERNEL_CACHE=str(tmp_path / "k"))
    proc = subprocess.run(
        [sys.executable, "-c", _ISA_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "native bf16 False" in proc.stdout  # neither level has AVX512-BF16


@needs_kernels
@pytest.mark.parametrize("dot", ["on", "off", "i16"])
def test_bf16_rows_in_each_mode(dot):
    """bf16 rows take VDPBF16PS on AMD and exact int16 planes with VPDPWSSD on Intel
    (build.py's `_bf16_mode`); every mode stays right on whatever CPU runs the suite, the
    switch forced by APPLIANCE_Q4G_BF16_DOT in a subprocess (a mode the CPU lacks widens)."""
    from engine.worker.cpu_features import detect_cpu_features

    env = dict(os.environ, APPLIANCE_Q4G_BF16_DOT=dot)  # the same library: a runtime switch
    proc = subprocess.run(
        [sys.executable, "-c", _ISA_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    has = {"on": detect_cpu_features().avx512_bf16, "off": False, "i16": _has_vnni512()}[dot]
    assert f"native bf16 {has}" in proc.stdout


def _has_vnni512() -> bool:
    """Whether -march=native gives the kernels AVX-512 VNNI (and the BW/VL they need)."""
    try:
        flags = next(
            line for line in open("/proc/cpuinfo").read().splitlines() if line.startswith("flags")
        ).split()
    except (OSError, StopIteration):
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"))
