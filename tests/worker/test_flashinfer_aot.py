"""The FlashInfer modules built ahead of time are the ones the backend loads (issue 14,
defects 3 and 8): FA2 prefill (not FA3's heavy sm90 build), no window, no soft cap."""

from __future__ import annotations

import torch

from engine.worker.attention import flashinfer_aot as aot
from engine.worker.attention.base import AttentionLayerSpec
from engine.worker.attention.flashinfer import plan_key
from tests.support.fake_flashinfer import fake_backend
from tests.support.paged_harness import build_metadata


def test_prefill_wrapper_uses_fa2():
    backend = fake_backend()
    spec = AttentionLayerSpec(4, 1, 16, 0.25)
    md = build_metadata([3, 2], [3, 2], [[0], [1]], 4)
    cache = torch.zeros(4, 2, 4, 1, 16)
    q, kv = torch.randn(5, 4, 16), torch.randn(5, 1, 16)
    backend.begin_step(md)
    backend.forward(q, kv, kv, cache, md, spec)
    (wrapper,) = backend._prefill.values()
    assert wrapper.backend == aot.PREFILL_BACKEND == "fa2"


def test_module_arguments_match_a_plain_layer_plan():
    key = plan_key(AttentionLayerSpec(32, 8, 128, 128**-0.5), torch.bfloat16, torch.bfloat16)
    (decode,) = [m for m in aot.required_modules([128], [torch.bfloat16]) if m.kind == "decode"]
    dq, dkv, do, idx, hqk, hvo, pos, window, softcap = decode.args()
    assert (dq, dkv, do, idx) == (key.q_dtype, key.kv_dtype, key.q_dtype, torch.int32)
    assert (hqk, hvo, pos) == (key.head_dim, key.head_dim, 0)
    assert window == (key.window_left != -1) and softcap == (key.soft_cap > 0)


def test_build_all_builds_decode_and_both_fa2_prefill_modules_once_each():
    calls = []

    class Spec:
        def __init__(self, name):
            self.name = name

        def build(self):
            calls.append(self.name)

    class Modules:
        def gen_batch_decode_module(self, *args):
            assert len(args) == 9
            return Spec("decode")

        def _gen_batch_prefill_primary_module(self, backend, *args):
            assert backend == "fa2" and len(args) == 10
            return Spec("primary")

        def _gen_batch_prefill_independent_paged_module(self, backend, *args):
            return Spec("paged")

    mods = aot.required_modules([64, 128], [torch.bfloat16])
    built = aot.build_all(mods, Modules())
    assert calls == ["decode", "primary", "paged"] * 2
    assert [b["module"] for b in built] == [m.name for m in mods]
    assert aot.main(["--list", "--head-dims", "128", "--dtypes", "bfloat16"]) == 0


def test_fp8_page_modules_pass_e4m3_as_the_kv_type_only():
    key = plan_key(AttentionLayerSpec(32, 8, 128, 128**-0.5), torch.bfloat16, torch.float8_e4m3fn)
    mods = aot.required_modules([128], [torch.bfloat16], [None, torch.float8_e4m3fn])
    assert [m.name for m in mods][3:] == [
        "decode-bfloat16-kv-float8_e4m3fn-d128", "prefill-fa2-bfloat16-kv-float8_e4m3fn-d128",
        "prefill-fa2-paged-bfloat16-kv-float8_e4m3fn-d128",
    ]  # fmt: skip
    assert [m.kv_dtype for m in mods[:3]] == [None] * 3  # the model's dtype, as before
    dq, dkv, do, idx = mods[4].args()[:4]
    assert (dq, dkv, do, idx) == (key.q_dtype, key.kv_dtype, key.q_dtype, torch.int32)
    assert aot.main(["--list", "--dtypes", "bfloat16", "--kv-dtypes", "auto,float8_e4m3fn"]) == 0


def test_tensor_core_decode_names_the_fa2_backend():
    """Not "auto", which picks per plan by dtype: fp8 pages must stay on the FA2 kernels."""
    from tests.support.fake_flashinfer import FakeFlashInfer

    made = []

    class Recording(FakeFlashInfer.BatchDecodeWithPagedKVCacheWrapper):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("backend"))
            super().__init__(*args, **kwargs)

    module = type("Rec", (FakeFlashInfer,), {"BatchDecodeWithPagedKVCacheWrapper": Recording})
    backend = fake_backend()
    backend._fi = module
    for heads, kv_heads in ((32, 8), (4, 2)):  # group 4: tensor cores; group 2: CUDA cores
        backend._new_decode(plan_key(AttentionLayerSpec(heads, kv_heads, 128, 0.1),
                                     torch.bfloat16, torch.float8_e4m3fn))  # fmt: skip
    assert made == ["fa2", None]
