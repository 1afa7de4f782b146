"""FlashInfer plan arrays and backend logic, checked on the CPU.

The index math is compared with values worked out by hand. The backend itself runs against
`FakeFlashInfer`, a stand-in module whose wrappers follow FlashInfer's documented contract
(CSR page table, causal bottom-right alignment, `window_left`, soft cap) with plain torch
math; its outputs must equal the exact torch backend, so the arrays, the KV scatter and the
one-plan-per-step bookkeeping are all exercised without a GPU.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.worker.attention.base import AttentionLayerSpec
from engine.worker.attention.flashinfer import (
    FlashInferBackend,
    FlashInferUnavailable,
    PlanKey,
    build_step_arrays,
    call_compat,
    check_version,
    device_page_indices,
    import_flashinfer,
    slot_write_indices,
    write_kv,
)
from engine.worker.attention.flashinfer_plan import (
    build_paged_kv_plan,
    page_gather_index,
    paged_kv_indptr,
    paged_kv_last_page_len,
    window_left,
)
from engine.worker.attention.torch_paged import TorchPagedBackend
from tests.support.fake_flashinfer import FakeFlashInfer, fake_backend
from tests.support.paged_harness import build_metadata

# Four requests, block_size 4, tables padded with 0. Worked by hand:
#   r0: seq 9  -> 3 pages [7, 2, 9], last page 9 - 8 = 1
#   r1: seq 4  -> 1 page  [5],       last page 4
#   r2: seq 1  -> 1 page  [3],       last page 1
#   r3: seq 14 -> 4 pages [1, 4, 6, 8], last page 14 - 12 = 2
TABLES = np.array([[7, 2, 9, 0], [5, 0, 0, 0], [3, 0, 0, 0], [1, 4, 6, 8]], dtype=np.int32)
SEQ_LENS = [9, 4, 1, 14]
QUERY_START = [0, 5, 6, 7, 8]  # r0 prefills a 5-token chunk, the others decode


def test_plan_arrays_match_hand_computed_values():
    plan = build_paged_kv_plan(TABLES, SEQ_LENS, QUERY_START, block_size=4)
    assert plan.qo_indptr.tolist() == [0, 5, 6, 7, 8]
    assert plan.paged_kv_indptr.tolist() == [0, 3, 4, 5, 9]
    assert plan.paged_kv_indices.tolist() == [7, 2, 9, 5, 3, 1, 4, 6, 8]
    assert plan.paged_kv_last_page_len.tolist() == [1, 4, 1, 2]
    for arr in (plan.qo_indptr, plan.paged_kv_indptr, plan.paged_kv_indices):
        assert arr.dtype == np.int32
    assert plan.paged_kv_last_page_len.dtype == np.int32
    assert (plan.num_reqs, plan.num_pages) == (4, 9)


def test_last_page_len_is_full_page_at_block_boundaries():
    assert paged_kv_last_page_len([16, 17, 32, 1], 16).tolist() == [16, 1, 16, 1]
    assert paged_kv_indptr([16, 17, 32, 1], 16).tolist() == [0, 1, 3, 5, 6]


def test_page_gather_index_addresses_the_flat_block_table():
    assert page_gather_index(SEQ_LENS, 4, table_width=4).tolist() == [0, 1, 2, 4, 8, 12, 13, 14, 15]
    assert page_gather_index([], 4, table_width=4).tolist() == []


def test_plan_rejects_empty_requests_and_narrow_tables():
    with pytest.raises(ValueError, match="seq_len >= 1"):
        paged_kv_indptr([3, 0], 4)
    with pytest.raises(ValueError, match="needs 5 pages"):
        page_gather_index([17], 4, table_width=4)


def test_window_left_is_window_minus_one():
    assert window_left(None) == -1
    assert window_left(4096) == 4095
    assert window_left(1) == 0


def test_step_arrays_gather_indices_from_the_device_block_table():
    md = build_metadata([5, 1, 1, 1], SEQ_LENS, [list(r) for r in TABLES], block_size=4)
    step = build_step_arrays(md)
    assert step.qo_indptr.tolist() == QUERY_START
    assert step.kv_indptr.tolist() == [0, 3, 4, 5, 9]
    assert step.kv_indices.tolist() == [7, 2, 9, 5, 3, 1, 4, 6, 8]
    assert step.kv_indices.dtype == torch.int32
    assert step.kv_last_page_len.tolist() == [1, 4, 1, 2]
    assert not step.decode_only


def test_slot_minus_one_rewrites_a_valid_tokens_slot_with_its_own_values():
    src, blocks, offsets = slot_write_indices(torch.tensor([5, -1, 9, -1]), block_size=4)
    assert src.tolist() == [0, 0, 2, 0]
    assert blocks.tolist() == [1, 1, 2, 1]
    assert offsets.tolist() == [1, 1, 1, 1]
    src, blocks, offsets = slot_write_indices(torch.tensor([-1, -1]), block_size=4)
    assert (blocks.tolist(), offsets.tolist()) == ([0, 0], [0, 0])


def test_write_kv_scatters_through_slots_and_skips_minus_one():
    cache = torch.randn(4, 2, 4, 2, 3)
    before = cache.clone()
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    slots = torch.tensor([6, -1, 13])
    write_kv(cache, k, v, slot_write_indices(slots, 4))
    expected = before.clone()
    expected[1, 0, 2], expected[1, 1, 2] = k[0], v[0]
    expected[3, 0, 1], expected[3, 1, 1] = k[2], v[2]
    assert torch.equal(cache, expected)


def test_import_on_cpu_says_why_flashinfer_is_unavailable():
    with pytest.raises(FlashInferUnavailable, match="CUDA device"):
        import_flashinfer(torch.device("cpu"))


def test_call_compat_drops_only_keywords_that_pick_a_kernel():
    def plan(indptr, indices, *, window_left=-1, logits_soft_cap=0.0):
        return indptr, indices, window_left, logits_soft_cap

    assert call_compat(plan, 1, 2, window_left=3, use_tensor_cores=True, backend="fa2") == (
        1, 2, 3, 0.0,
    )  # fmt: skip

    def plan_any(a, **kwargs):
        return kwargs

    assert call_compat(plan_any, 1, window_left=3, kv_data_type="x") == {
        "window_left": 3,
        "kv_data_type": "x",
    }


@pytest.mark.parametrize("keyword", ["window_left", "logits_soft_cap", "kv_data_type"])
def test_call_compat_refuses_to_drop_a_keyword_that_changes_attention(keyword):
    def plan(indptr, indices, *, sm_scale=None):  # a version without the keyword
        return indptr

    with pytest.raises(FlashInferUnavailable, match=f"does not accept \\['{keyword}'\\]"):
        call_compat(plan, 1, 2, sm_scale=0.5, **{keyword: 1})


def test_graph_wrapper_refused_by_a_version_without_use_cuda_graph():
    class OldDecode:  # no graph mode: its kernels would read host-planned, moving arrays
        def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False):
            pass

    module = type("OldFlashInfer", (FakeFlashInfer,), {})
    module.BatchDecodeWithPagedKVCacheWrapper = OldDecode
    fi = FlashInferBackend(torch.device("cpu"), workspace_bytes=16, flashinfer_module=module)
    with pytest.raises(FlashInferUnavailable, match="use_cuda_graph"):
        fi.make_graph_state(1, max_num_pages=4, specs=[_spec()], dtype=torch.bfloat16)


@pytest.mark.parametrize("version", ["0.6.1", "0.8.0", "1.7.2", "", "fake"])
def test_other_flashinfer_releases_are_refused_with_the_version(version):
    module = type("Other", (FakeFlashInfer,), {"__version__": version})
    with pytest.raises(FlashInferUnavailable, match="not a 0.7.x release"):
        FlashInferBackend(torch.device("cpu"), workspace_bytes=16, flashinfer_module=module)
    assert check_version(FakeFlashInfer) == "0.7.2.post1"
    assert check_version(type("Post", (), {"__version__": "0.7.0rc1"})) == "0.7.0rc1"


def test_group_of_four_query_heads_gets_tensor_core_decode():
    fi = fake_backend()

    def key(heads, kv_heads):
        return PlanKey(heads, kv_heads, 128, 0.1, -1, 0.0, torch.bfloat16, torch.bfloat16)

    assert fi._use_tensor_cores(key(32, 8))  # Llama-3-8B: group 4
    assert fi._use_tensor_cores(key(64, 8))
    assert not fi._use_tensor_cores(key(16, 8))
    assert not fi._use_tensor_cores(key(12, 4))


def test_prefill_wrappers_use_the_fa2_backend_by_default():
    made = []

    class Recording(FakeFlashInfer.BatchPrefillWithPagedKVCacheWrapper):
        def __init__(self, *args, backend="auto", **kwargs):
            made.append(backend)
            super().__init__(*args, **kwargs)

    module = type("Rec", (FakeFlashInfer,), {"BatchPrefillWithPagedKVCacheWrapper": Recording})
    fi = FlashInferBackend(torch.device("cpu"), workspace_bytes=16, flashinfer_module=module)
    fi._new_prefill()
    assert made == ["fa2"]


@pytest.mark.parametrize("seed", range(4))
def test_device_page_indices_equal_the_host_plan(seed):
    gen = torch.Generator().manual_seed(seed)
    num_reqs, width, bs = 6, 9, 4
    lens = torch.randint(1, width * bs + 1, (num_reqs,), generator=gen)
    tables = torch.randint(0, 100, (num_reqs + 2, width + 3), generator=gen, dtype=torch.int32)
    view = tables[:num_reqs, :width]  # a non-contiguous view, like a bucket's block table
    plan = build_paged_kv_plan(view.numpy(), lens.tolist(), list(range(num_reqs + 1)), bs)
    got = device_page_indices(view, lens.to(torch.int32), bs, plan.num_pages)
    assert got.dtype == torch.int32
    assert got.tolist() == plan.paged_kv_indices.tolist()


def _spec(window: int | None = None, soft_cap: float | None = None) -> AttentionLayerSpec:
    return AttentionLayerSpec(4, 2, 8, 8**-0.5, sliding_window=window, logits_soft_cap=soft_cap)


def _attend_all_layers(backend, md, specs, caches, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = md.num_tokens
    outs = []
    backend.begin_step(md)
    for spec, cache in zip(specs, caches, strict=True):
        q = torch.randn(T, 4, 8, generator=gen)
        k, v = torch.randn(T, 2, 8, generator=gen), torch.randn(T, 2, 8, generator=gen)
        outs.append(backend.forward(q, k, v, cache, md, spec))
    return outs


@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [
        ([5, 1, 1, 3], [9, 4, 1, 14]),  # mixed: prefill chunks behind cached context + decodes
        ([1, 1, 1, 1], [9, 4, 1, 14]),  # decode only
    ],
)
def test_fake_flashinfer_backend_equals_torch_backend(q_lens, seq_lens):
    specs = [_spec(), _spec(window=3), _spec(soft_cap=5.0), _spec()]
    tables = [list(r) for r in TABLES]
    md = build_metadata(q_lens, seq_lens, tables, block_size=4, slot_overrides=None)
    base = torch.randn(10, 2, 4, 2, 8)
    ref_caches = [base.clone() for _ in specs]
    fi_caches = [base.clone() for _ in specs]
    ref = _attend_all_layers(TorchPagedBackend(), md, specs, ref_caches)
    fi = fake_backend()
    got = _attend_all_layers(fi, md, specs, fi_caches)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    for r, g in zip(ref_caches, fi_caches, strict=True):
        assert torch.equal(r, g)
    # One wrapper and one plan per distinct kind of layer, shared by the layers of that kind.
    pool = fi._decode if md.is_decode_only else fi._prefill
    assert len(pool) == 3
    assert sorted(len(w.plans) for w in pool.values()) == [1, 1, 1]
    assert sum(w.runs for w in pool.values()) == 4
    other = fi._prefill if md.is_decode_only else fi._decode
    assert not other
    causal = {p["causal"] for w in pool.values() for p in w.plans}
    assert causal == ({False} if md.is_decode_only else {True})


def test_each_step_plans_again_and_windows_reach_the_plan():
    fi = fake_backend()
    specs = [_spec(window=3)]
    caches = [torch.zeros(10, 2, 4, 2, 8)]
    tables = [list(r) for r in TABLES]
    _attend_all_layers(fi, build_metadata([1] * 4, SEQ_LENS, tables, 4), specs, caches)
    _attend_all_layers(fi, build_metadata([1] * 4, [10, 5, 2, 15], tables, 4), specs, caches)
    (wrapper,) = fi._decode.values()
    assert len(wrapper.plans) == 2
    assert wrapper.plans[-1]["window_left"] == 2
    assert wrapper.plans[-1]["last"].tolist() == [2, 1, 2, 3]
    assert math.isclose(wrapper.plans[-1]["scale"], 8**-0.5)


def test_graph_state_plans_into_fixed_buffers():
    fi = fake_backend()
    specs = [_spec(), _spec(window=3)]
    state = fi.make_graph_state(4, max_num_pages=16, specs=specs, dtype=torch.float32)
    assert len(state.wrappers) == 2
    tables = [list(r) for r in TABLES]
    md = build_metadata([1] * 4, SEQ_LENS, tables, block_size=4)
    fi.begin_graph_step(state, md)
    assert state.indptr_buf.tolist() == [0, 3, 4, 5, 9]
    assert state.indices_buf[:9].tolist() == [7, 2, 9, 5, 3, 1, 4, 6, 8]
    assert state.last_page_len_buf.tolist() == [1, 4, 1, 2]
    assert all(w.use_cuda_graph for w in state.wrappers.values())
    with pytest.raises(ValueError, match="graph state for 4"):
        fi.begin_graph_step(state, build_metadata([1, 1], [3, 3], [[1], [2]], block_size=4))
    with pytest.raises(ValueError, match="largest graph state first"):
        fi.make_graph_state(8, max_num_pages=32, specs=specs, dtype=torch.float32)


def test_float32_cache_is_refused_with_the_reason():
    fi = FlashInferBackend(
        torch.device("cpu"), workspace_bytes=16, flashinfer_module=FakeFlashInfer
    )
    md = build_metadata([1], [3], [[1]], block_size=4)
    q, kv = torch.randn(1, 4, 8), torch.randn(1, 2, 8)
    with pytest.raises(FlashInferUnavailable, match="fp16/bf16"):
        fi.forward(q, kv, kv, torch.zeros(4, 2, 4, 2, 8), md, _spec())
