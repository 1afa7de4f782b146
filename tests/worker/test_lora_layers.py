"""The batched LoRA product: rows grouped by slot (`LoRABatch`), the LRU slot table, and
`LoRALinear` against a per-row reference on a fused q/k/v layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from engine.worker.lora.batch import build_lora_batch
from engine.worker.lora.layers import LoRALinear, LoRAStep
from engine.worker.lora.slots import SlotTable
from engine.worker.models.cpu_linear import pack_linears, packing_available
from engine.worker.models.layers import FusedLinear

CPU = torch.device("cpu")


def _batch(request_slots, query_lens):
    return build_lora_batch(np.array(request_slots), np.array(query_lens), CPU)


def test_rows_are_grouped_by_slot_and_padded():
    # token slots [2 2 2 -1 0 1 0]: requests (slot, rows) = (2, 3), (-1, 1), (0, 1), (1, 1), (0, 1)
    b = _batch([2, -1, 0, 1, 0], [3, 1, 1, 1, 1])
    assert b.slots == [0, 1, 2] and b.slot_range == (0, 3) and b.rows_per_slot == 3
    assert b.padded_rows.tolist() == [4, 6, 4, 5, 4, 4, 0, 1, 2]
    assert b.num_positions == 9
    assert b.gather_back.tolist() == [6, 7, 8, 9, 0, 3, 1]  # 9: the zero row


def test_balanced_rows_need_no_padding():
    b = _batch([1, 3, 1, 3, -1], [1, 1, 1, 1, 1])
    assert b.slot_range == (1, 4)  # slot 2 is idle: its padded rows are dropped
    b = _batch([1, 2, 1, 2], [1, 1, 1, 1])
    assert b.padded_rows.tolist() == [0, 2, 1, 3] and b.num_positions == 4
    assert b.gather_back.tolist() == [0, 2, 1, 3]


def test_a_long_prefill_beside_decodes_goes_slot_by_slot():
    b = _batch([0, 1, 2, 3], [40, 1, 1, 1])  # padding 4 x 40 rows for 43: one product per slot
    assert b.padded_rows is None
    segments = [(slot, rows.tolist(), start) for slot, rows, start in b.segments]
    assert segments == [(0, list(range(40)), 0), (1, [40], 40), (2, [41], 41), (3, [42], 42)]
    assert b.gather_back.tolist() == list(range(43))


def test_a_step_without_adapters_has_no_batch():
    assert _batch([-1, -1], [3, 1]) is None


def test_slots_are_reused_and_evicted_least_recently_used():
    t = SlotTable(2)
    assert t.assign([b"a", b"b"]) == ({b"a": 0, b"b": 1}, [(0, b"a"), (1, b"b")])
    assert t.assign([b"b"]) == ({b"b": 1}, [])
    assert t.assign([b"c", b"b"]) == ({b"b": 1, b"c": 0}, [(0, b"c")])  # a was older
    assert t.assign([b"a", b"c"]) == ({b"c": 0, b"a": 1}, [(1, b"a")])  # b is not needed
    assert t.num_loads == 4
    with pytest.raises(RuntimeError, match="3 adapters but there are 2 slots"):
        t.assign([b"a", b"b", b"c"])


SIZES = {"q": 32, "k": 16, "v": 16}
MAX_RANK = 8


def _adapters(seed: int) -> list[dict]:
    """Three adapters for layer 0 of a q/k/v layer: ranks 8, 3 and 5; the third leaves k."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r, projs in ((8, "qkv"), (3, "qkv"), (5, "qv")):
        out.append(
            {
                (0, f"{p}_proj"): (
                    torch.randn(r, 24, generator=g),
                    torch.randn(SIZES[p], r, generator=g),
                )
                for p in projs
            }
        )
    return out


def _reference(base: nn.Module, x: torch.Tensor, row_adapters: list[dict | None]):
    """base(x) plus each row's B A x per slice, in float32."""
    y = base(x).float()
    x = x.float()
    for i, modules in enumerate(row_adapters):
        if modules is None:
            continue
        start = 0
        for p, size in SIZES.items():
            piece = modules.get((0, f"{p}_proj"))
            if piece is not None:
                a, b = piece
                y[i, start : start + size] += b @ (a @ x[i])
            start += size
    return y


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "request_slots,query_lens",
    [([0, 1, 2, -1, 1, 0], [1, 1, 1, 1, 1, 1]), ([2, 0, -1, 1], [9, 1, 2, 1])],
    ids=["decode-bmm", "prefill-per-slot"],
)
def test_lora_linear_adds_each_rows_adapter_to_its_slices(packed, request_slots, query_lens):
    if packed and not packing_available():
        pytest.skip("oneDNN packing unavailable")
    torch.manual_seed(0)
    base = FusedLinear(24, SIZES, bias=True)
    holder = nn.Sequential(base)
    if packed:
        assert pack_linears(holder) == 1
    step = LoRAStep()
    layer = LoRALinear(base, 0, ("q_proj", "k_proj", "v_proj"), 3, MAX_RANK, step)
    adapters = _adapters(seed=1)
    for slot, modules in enumerate(adapters):
        layer.load_slot(slot, modules)
    step.batch = _batch(request_slots, query_lens)
    assert (step.batch.padded_rows is None) == (query_lens[0] == 9)
    x = torch.randn(sum(query_lens), 24)
    rows = [
        None if s < 0 else adapters[s]
        for s, n in zip(request_slots, query_lens, strict=True)
        for _ in range(n)
    ]
    with torch.inference_mode():
        got = layer(x)
        want = _reference(base, x, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, base(x))


def test_slots_without_weights_for_a_layer_skip_its_product():
    base = nn.Linear(24, 16)
    step = LoRAStep()
    layer = LoRALinear(base, 1, ("o_proj",), 2, MAX_RANK, step)
    layer.load_slot(0, {(0, "o_proj"): (torch.ones(2, 24), torch.ones(16, 2))})  # layer 0 only
    step.batch = _batch([0], [3])
    x = torch.randn(3, 24)
    assert layer.filled == [False, False]
    with torch.inference_mode():
        assert torch.equal(layer(x), base(x))


def test_a_bf16_layer_adds_a_float32_delta():
    torch.manual_seed(0)
    base = FusedLinear(24, SIZES, bias=False).to(torch.bfloat16)
    step = LoRAStep()
    layer = LoRALinear(base, 0, ("q_proj", "k_proj", "v_proj"), 3, MAX_RANK, step)
    assert layer.lora_a.dtype == torch.float32  # on the CPU the LoRA math stays fp32
    adapters = _adapters(seed=2)
    for slot, modules in enumerate(adapters):
        layer.load_slot(slot, modules)
    step.batch = _batch([1, 0, -1, 2], [1, 1, 1, 1])
    x = torch.randn(4, 24).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
        want = _reference(base, x, [adapters[1], adapters[0], None, adapters[2]])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)
