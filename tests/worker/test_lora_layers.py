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
    return build_lora_batch(np.array(request_slots), np.array(query_lens))


def test_each_slot_gets_its_range_of_rows():
    b = _batch([0, 0, 1, 3, -1], [2, 2, 2, 4, 2])
    assert b.slots == (0, 1, 3)
    assert b.segments == ((0, 0, 4), (1, 4, 6), (3, 6, 10))
    assert b.uniform is None  # unequal ranges, and slot 2 is idle


def test_equal_ranges_over_consecutive_slots_make_one_bmm():
    assert _batch([0, 1, 2, 3], [16, 16, 16, 16]).uniform == (0, 4, 16)
    assert _batch([1, 1, 2, 2, -1], [1, 1, 1, 1, 1]).uniform == (1, 3, 2)
    assert _batch([0, 2], [1, 1]).uniform is None


def test_a_step_without_adapters_has_no_batch_and_order_is_checked():
    assert _batch([-1, -1], [3, 1]) is None
    with pytest.raises(ValueError, match="ordered by adapter slot"):
        _batch([1, 0], [1, 1])
    with pytest.raises(ValueError, match="base model last"):
        _batch([-1, 0], [1, 1])


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
    [([0, 0, 1, 1, 2, 2, -1], [1, 1, 1, 1, 1, 1, 1]), ([0, 1, 2, -1], [9, 1, 2, 1])],
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
    assert (step.batch.uniform is None) == (query_lens[0] == 9)
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
    step.batch = _batch([0, 1, 1, -1], [1, 2, 1, 1])
    x = torch.randn(5, 24).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
        want = _reference(base, x, [adapters[0], adapters[1], adapters[1], adapters[1], None])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)


def test_requests_are_ordered_by_slot_with_the_base_model_last(tiny_llama_dir):
    from transformers import AutoConfig

    from engine.config import LoRAConfig
    from engine.lora_request import LoRARequest
    from engine.worker.lora.model_lora import ModelLoRA
    from engine.worker.lora.peft_adapter import LoRAWeights
    from engine.worker.models.loader import build_model

    model = build_model(AutoConfig.from_pretrained(tiny_llama_dir), torch.float32, CPU)
    lora = ModelLoRA(model, LoRAConfig(enabled=True, max_loras=2, max_lora_rank=4))
    assert isinstance(model.model.layers[1].mlp.gate_up_proj, LoRALinear)
    assert len(lora.wrappers) == 4 * 2
    a, b = (LoRAWeights(LoRARequest(k, ord(k), "/x"), k.encode(), 2, {}) for k in "ab")
    ids, slots = lora.order_step(["r0", "r1", "r2", "r3"], [None, b, a, b])
    assert ids == ["r1", "r3", "r2", "r0"] and slots.tolist() == [0, 0, 1, -1]
    ids, slots = lora.order_step(["r0", "r1"], [None, None])
    assert ids == ["r0", "r1"] and slots.tolist() == [-1, -1]
