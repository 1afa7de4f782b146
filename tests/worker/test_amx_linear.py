"""The AMX bf16 linear (csrc/amx_linear.c): its tile layout, its sums against float64 at every
row-count shape the tiles split into, its agreement with oneDNN, and which bf16 steps
models/cpu_linear.py hands it. Kernel checks skip where the CPU (or the kernel) gives no AMX;
the rule and the stub build run everywhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.kernels import amx_linear
from engine.worker.models import cpu_linear
from engine.worker.models.cpu_linear import AMX_MAX_ROWS, AmxWeight, pack_linears, pack_weight

needs_amx = pytest.mark.skipif(not amx_linear.available(), reason="no AMX tiles here")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _data(m: int, n: int, k: int, seed: int, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


def _check_sums(y: torch.Tensor, x, w, b) -> None:
    """y is the exact sum rounded once to bf16, up to fp32 summation error: within half a
    bf16 step of the float64 result plus 2^-20 of the sum of |products|."""
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    mag = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0.0)
    err = (y.double() - ref).abs()
    bound = ref.abs() * 2.0**-8 + mag * 2.0**-20
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max()):.3g}"


def test_the_shape_rule():
    assert amx_linear.supports(16, 32) and amx_linear.supports(49152, 576)
    assert not amx_linear.supports(40, 32)  # N not a multiple of 16
    assert not amx_linear.supports(48, 40)  # K not a multiple of 32
    assert not amx_linear.supports(0, 32)


@needs_amx
def test_pack_puts_each_value_pair_where_the_tiles_read_it():
    n, k = 32, 64
    w = torch.arange(n * k, dtype=torch.float32).view(n, k).remainder(251).to(torch.bfloat16)
    tiles = amx_linear.pack(w).view(n // 16, k // 32, 16, 16, 2)  # [nb][kb][pair][col][2]
    for nb in range(n // 16):
        for kb in range(k // 32):
            for r in (0, 7, 15):
                for c in (0, 5, 15):
                    for j in (0, 1):
                        assert tiles[nb, kb, r, c, j] == w[nb * 16 + c, kb * 32 + 2 * r + j]


@needs_amx
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 31, 32, 33, 64, 255, 256, 257, 300])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (1024, 512)])
def test_sums_are_exact_but_for_fp32_order(m, n, k):
    x, w, b = _data(m, n, k, seed=m * 7 + n)
    tiles = amx_linear.pack(w)
    _check_sums(amx_linear.linear(x, tiles, b, n), x, w, b)
    _check_sums(amx_linear.linear(x, tiles, None, n), x, w, None)


@needs_amx
def test_rows_of_a_wider_tensor_and_one_thread_give_the_same_bits():
    x, w, b = _data(70, 96, 64, seed=5)
    wide = torch.zeros(70, 160, dtype=torch.bfloat16)
    wide[:, 32:96] = x
    tiles = amx_linear.pack(w)
    y = amx_linear.linear(x, tiles, b, 96)
    assert torch.equal(amx_linear.linear(wide[:, 32:96], tiles, b, 96), y)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(amx_linear.linear(x, tiles, b, 96), y)  # each output: one order
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_agrees_with_onednn_but_for_the_last_bit_of_a_few_outputs():
    x, w, _ = _data(64, 1024, 512, seed=11, bias=False)
    ours = amx_linear.linear(x, amx_linear.pack(w), None, 1024)
    dnn = cpu_linear.packed_linear(x, pack_weight(w, amx=False), None, 1024)
    differ = ours != dnn
    assert differ.float().mean() < 1e-3
    ulp = torch.frexp(dnn[differ].float())[1].float().sub(8).exp2()
    assert bool(((ours[differ].float() - dnn[differ].float()).abs() <= ulp).all())


@needs_amx
def test_bf16_layers_take_the_kernel_up_to_the_row_limit_then_f_linear():
    torch.manual_seed(0)
    layer = nn.Linear(64, 48).to(torch.bfloat16)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    assert pack_linears(layer) == 1
    assert isinstance(layer.packed_weight, AmxWeight)
    assert layer.packed_weight.dense.data_ptr() == layer.weight.data_ptr()  # no second copy
    for rows in (1, 9, AMX_MAX_ROWS):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert torch.equal(layer(x), amx_linear.linear(x, layer.packed_weight.tiles, b, 48))
    x = torch.randn(AMX_MAX_ROWS + 1, 64).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, w, b))
    x3 = torch.randn(2, 5, 64).to(torch.bfloat16)  # leading dims are kept
    assert torch.equal(layer(x3), layer(x3.reshape(10, 64)).view(2, 5, 48))


def test_other_weights_keep_onednn(monkeypatch):
    if not cpu_linear.packing_available(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bf16 here")
    odd = nn.Linear(40, 48).to(torch.bfloat16)  # K = 40: not a tile multiple
    pack_linears(odd)
    assert isinstance(odd.packed_weight, torch.Tensor)
    fp32 = nn.Linear(64, 48)
    pack_linears(fp32)
    assert isinstance(fp32.packed_weight, torch.Tensor)
    monkeypatch.setattr(amx_linear, "available", lambda: False)  # APPLIANCE_AMX_LINEAR=off
    off = nn.Linear(64, 48).to(torch.bfloat16)
    pack_linears(off)
    assert isinstance(off.packed_weight, torch.Tensor)


def test_the_switch_and_a_build_without_amx_report_no_tiles(tmp_path):
    """An x86-64-v3 build (no AMX instructions: the stubs) reports no tiles and still loads
    every other kernel; `APPLIANCE_AMX_LINEAR=off` leaves available() False either way."""
    check = (
        "import torch\n"
        "from engine.worker.kernels import amx_linear\n"
        "from engine.worker.kernels.build import library\n"
        "assert library() is not None\n"
        "assert not amx_linear.available()\n"
    )
    cases = (
        ({"APPLIANCE_KERNEL_MARCH": "x86-64-v3", "APPLIANCE_KERNEL_CACHE": str(tmp_path / "v3")},
         check + "assert library().amx_bf16_ready() == 0\n"),
        ({"APPLIANCE_AMX_LINEAR": "off"}, check),
    )  # fmt: skip
    for env_extra, code in cases:
        env = dict(os.environ, **env_extra)
        proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
