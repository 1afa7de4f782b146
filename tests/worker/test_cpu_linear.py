"""The packed (oneDNN) linear: where fp32 switches to it, and that it computes F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.models.cpu_linear import (
    SMALL_ROWS_INTEL,
    fp32_small_rows_for,
    pack_linears,
    packing_available,
    small_rows,
)


def test_fp32_keeps_mkl_below_the_crossover_on_intel_only():
    assert fp32_small_rows_for("GenuineIntel") == SMALL_ROWS_INTEL == 4
    assert fp32_small_rows_for("") == SMALL_ROWS_INTEL  # unknown: the rule measured first
    assert fp32_small_rows_for("AuthenticAMD") == 1
    assert small_rows(torch.bfloat16) == 1


@pytest.mark.skipif(not packing_available(), reason="oneDNN packing unavailable")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_a_packed_linear_equals_f_linear_at_every_row_count(rows):
    torch.manual_seed(0)
    layer = nn.Linear(64, 48)
    ref_w, ref_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    assert pack_linears(layer) == 1
    x = torch.randn(rows, 64)
    torch.testing.assert_close(layer(x), F.linear(x, ref_w, ref_b), rtol=1e-5, atol=1e-5)
