"""The q4/q8 block formats and the block linear: exact layouts, the kernel equal to the
dequantized product on both sides of the row-count rule, slicing at block boundaries."""

from __future__ import annotations

import pytest
import torch

from engine.worker.kernels import quant as qkernels
from engine.worker.quant import linear as qlinear
from engine.worker.quant.blocks import (
    Q4,
    Q8,
    BlockTensor,
    dequantize,
    pack_q4,
    quantize_q4,
    quantize_q8,
    round_activations_int8,
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


@needs_kernels
@pytest.mark.parametrize("kind", [Q4, Q8])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_block_kernel_equals_the_dequantized_product(kind, rows):
    w = _w(n=40, k=96)
    t = quantize_q4(w) if kind == Q4 else quantize_q8(w)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(40)
    y = qkernels.linear(x, t.data, kind, 96, bias)
    expected = x.double() @ dequantize(t).double().t() + bias.double()
    torch.testing.assert_close(y.double(), expected, atol=2e-6, rtol=1e-5)


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
    wd = dequantize(BlockTensor(Q4, layer.qdata, 96)).double()
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


@pytest.mark.parametrize("rows", [1, qlinear.DENSE_ROWS - 1, qlinear.DENSE_ROWS, 70])
def test_quant_linear_gives_one_answer_on_both_sides_of_the_row_rule(rows):
    w, bias = _w(n=64, k=96), torch.randn(64)
    layer = _layer(w, Q4, bias)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(2))
    expected = x.double() @ dequantize(BlockTensor(Q4, layer.qdata, 96)).double().t()
    torch.testing.assert_close(layer(x).double(), expected + bias.double(), atol=2e-5, rtol=1e-4)
    bf = layer(x.bfloat16())
    assert bf.dtype == torch.bfloat16 and bf.shape == (rows, 64)


def test_fused_shards_join_in_order_and_a_missing_one_is_refused():
    q, k = _w(n=32, seed=3), _w(n=16, seed=4)
    layer = QuantLinear(96, 48, False, target=Q8, shard_sizes={"q": 32, "k": 16})
    layer.load_tensor("weight", "k", k)
    layer.load_tensor("weight", "q", q)
    layer.finalize()
    torch.testing.assert_close(
        dequantize(BlockTensor(Q8, layer.qdata, 96)),
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
@pytest.mark.parametrize("kind", [Q4, Q8])
def test_the_bf16_copy_is_the_blocks_rounded_to_bf16(kind):
    w = _w(n=40, k=96)
    t = quantize_q4(w) if kind == Q4 else quantize_q8(w)
    out = qkernels.dequantize_into(t.data, kind, 96, torch.empty(40, 96, dtype=torch.bfloat16))
    ref = dequantize(t, torch.bfloat16)
    # the same fp32 value rounded to nearest even (an FMA in d q + m may move one ulp)
    torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=2**-8)


@needs_kernels
def test_bf16_activations_at_many_rows_run_the_bf16_gemm_on_the_bf16_copy():
    w, bias = _w(n=64, k=96), torch.randn(64)
    layer = _layer(w, Q4, bias)
    x = torch.randn(qlinear.DENSE_ROWS + 6, 96, generator=torch.Generator().manual_seed(3))
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16
    wd = dequantize(BlockTensor(Q4, layer.qdata, 96), torch.bfloat16).double()
    expected = x.bfloat16().double() @ wd.t() + bias.bfloat16().double()
    torch.testing.assert_close(y.double(), expected, atol=3e-2, rtol=1e-2)
