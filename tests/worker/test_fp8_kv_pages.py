"""fp8 KV pages (`cache.kv_dtype: fp8_e4m3`) on the CPU, with the stand-in flashinfer module.

The stand-in (tests/support/fake_flashinfer.py) follows FlashInfer's contract for fp8 pages:
plans carry `kv_data_type`, a run refuses pages of another dtype than planned, and its
attention widens the e4m3 pages to the queries' dtype. So what the backend writes is what
is read: attention over fp8 pages must equal the exact torch backend run on the same values
(the cache and the new K/V rounded through e4m3 first) within float32 rounding, and stay
within `FP8_ATOL` of attention over full-precision pages. A write that is not e4m3 fails both.

Measured here (N(0, 1) queries, keys, values; 4 query / 2 KV heads, dim 8; contexts up to
14; 20 seeds, mixed and decode-only steps): fp8 pages vs the torch backend on their values
4.8e-7 at most (tolerance 1e-5, as the other stand-in tests); vs full precision 0.116 at
most (tolerance `FP8_ATOL` 0.25). A write of e5m2 bytes (the right size, the wrong format),
read as e4m3: 0.50 to 0.86 from full precision, 0.5 or more from the exact reference.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, ModelConfig, RuntimeConfig
from engine.worker.attention import flashinfer as fi_module
from engine.worker.attention.base import AttentionLayerSpec
from engine.worker.attention.flashinfer import slot_write_indices, write_kv
from engine.worker.attention.kv_dtype import (
    kv_cache_dtype,
    new_kv_cache,
    page_bytes,
    to_fp8,
    to_page_values,
)
from engine.worker.attention.probe import AttentionProbeError, probe_attention
from engine.worker.attention.selection import select_attention_backend
from engine.worker.attention.torch_paged import TorchPagedBackend
from engine.worker.decode_graphs import GraphRunner
from engine.worker.kv_sizing import KVGeometry, num_blocks_for_cpu, num_blocks_for_gpu
from engine.worker.models.loader import load_model
from engine.worker.quant.fp8 import check_kv_dtype
from engine.worker.runner import ModelRunner
from tests.support.fake_flashinfer import FakeFlashInfer, _FakePrefill, _FakeWrapper, fake_backend
from tests.support.fake_graphs import ReplayGraph
from tests.support.graph_equality import check_graph_decode, long_prompts
from tests.support.paged_harness import PagedRun, build_metadata

CPU = torch.device("cpu")
BF16, F32, F8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
FP8_ATOL = 0.25  # attention over fp8 pages vs full precision (measured 0.116)
TABLES = [[7, 2, 9, 0], [5, 0, 0, 0], [3, 0, 0, 0], [1, 4, 6, 8]]
SPEC = AttentionLayerSpec(4, 2, 8, 8**-0.5)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(ModelConfig(path=str(tiny_llama_dir)), CPU).model


@pytest.fixture(scope="module")
def bf16_model(tiny_llama_dir):
    return load_model(ModelConfig(path=str(tiny_llama_dir), dtype="bfloat16"), CPU).model


# ---- the write: e4m3, scale 1, saturating ---------------------------------------------------
def test_the_setting_resolves_to_e4m3_pages_or_the_model_dtype():
    assert kv_cache_dtype("fp8_e4m3", BF16) == F8
    assert kv_cache_dtype("auto", BF16) == BF16
    assert new_kv_cache((2, 3), F8, CPU).dtype == F8
    assert page_bytes(new_kv_cache((2, 3), F8, CPU)).eq(0).all()


def test_writes_round_to_nearest_e4m3_and_saturate_at_448():
    x = torch.tensor([500.0, -1000.0, 448.0, 3.3, 0.001, 1e-5, 2.0**-6 * 1.05])
    got = to_fp8(x).float().tolist()
    assert got == [448.0, -448.0, 448.0, 3.25, 2.0**-9, 0.0, 2.0**-6]
    r = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 30
    err = (to_fp8(r).float() - r).abs()
    normal = r.abs() >= 2.0**-6
    assert float((err[normal] / r.abs()[normal]).max()) <= 2.0**-4  # 3 mantissa bits
    assert float(err[~normal].max()) <= 2.0**-10  # subnormal spacing 2**-9
    assert torch.equal(to_page_values(x, F8), to_fp8(x).view(torch.uint8))
    assert to_page_values(x, BF16).dtype == BF16


def test_the_backend_scatter_writes_e4m3_bytes_through_the_slot_mapping():
    cache = new_kv_cache((4, 2, 4, 2, 3), F8, CPU)
    k, v = 40 * torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    write_kv(cache, k, v, slot_write_indices(torch.tensor([6, -1, 13]), 4))
    want = torch.zeros(4, 2, 4, 2, 3)
    want[1, 0, 2], want[1, 1, 2] = to_fp8(k[0]).float(), to_fp8(v[0]).float()
    want[3, 0, 1], want[3, 1, 1] = to_fp8(k[2]).float(), to_fp8(v[2]).float()
    assert cache.dtype == F8 and torch.equal(cache.float(), want)


# ---- plans and attention --------------------------------------------------------------------
def _attend(backend, md, cache, seed, kv_round=False):
    gen = torch.Generator().manual_seed(seed)
    T = md.num_tokens
    q = torch.randn(T, 4, 8, generator=gen)
    k, v = torch.randn(T, 2, 8, generator=gen), torch.randn(T, 2, 8, generator=gen)
    if kv_round:  # the reference is fed what fp8 pages will hold
        k, v = to_fp8(k).float(), to_fp8(v).float()
    backend.begin_step(md)
    return backend.forward(q, k, v, cache, md, SPEC)


@pytest.mark.parametrize(
    "q_lens,seq_lens", [([5, 1, 1, 3], [9, 4, 1, 14]), ([1, 1, 1, 1], [9, 4, 1, 14])],
    ids=["mixed", "decode"],
)  # fmt: skip
def test_attention_over_fp8_pages_equals_the_torch_backend_on_their_values(q_lens, seq_lens):
    md = build_metadata(q_lens, seq_lens, TABLES, 4)
    base = torch.randn(10, 2, 4, 2, 8, generator=torch.Generator().manual_seed(1))
    fi = fake_backend()
    pages = to_fp8(base)
    got = _attend(fi, md, pages, seed=2)
    ref_cache = to_fp8(base).float()
    ref = _attend(TorchPagedBackend(), md, ref_cache, seed=2, kv_round=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(page_bytes(pages), page_bytes(to_fp8(ref_cache)))
    full = _attend(TorchPagedBackend(), md, base.clone(), seed=2)
    assert float((got - full).abs().max()) <= FP8_ATOL
    # Planned as FlashInfer wants them: queries in their dtype, pages e4m3.
    pool = fi._decode if md.is_decode_only else fi._prefill
    plans = [p for w in pool.values() for p in w.plans]
    assert plans and {(p["q_dtype"], p["kv_dtype"]) for p in plans} == {(F32, F8)}
    assert {k.kv_dtype for k in pool} == {F8}


def test_a_write_that_is_not_e4m3_fails_the_comparison_and_the_probe(monkeypatch):
    def e5m2(x, dtype):  # the right size, the wrong format
        return x.to(torch.float8_e5m2).view(torch.uint8) if dtype == F8 else x.to(dtype)

    md = build_metadata([5, 1, 1, 3], [9, 4, 1, 14], TABLES, 4)
    base = torch.randn(10, 2, 4, 2, 8, generator=torch.Generator().manual_seed(1))
    full = _attend(TorchPagedBackend(), md, base.clone(), seed=2)
    exact = _attend(TorchPagedBackend(), md, to_fp8(base).float(), seed=2, kv_round=True)
    monkeypatch.setattr(fi_module, "to_page_values", e5m2)
    got = _attend(fake_backend(), md, to_fp8(base), seed=2)
    assert float((got - full).abs().max()) > FP8_ATOL
    assert float((got - exact).abs().max()) > 1e4 * 1e-5
    backend = fake_backend()
    backend.cache_dtypes = (BF16,)
    with pytest.raises(AttentionProbeError, match="KV cache written differs"):
        probe_attention(backend, [SPEC], 4, BF16, CPU, kv_dtype=F8)


def test_pages_of_another_dtype_than_planned_are_refused_like_flashinfer():
    fi = fake_backend()
    md = build_metadata([1], [3], [[1]], block_size=4)
    fi.begin_step(md)
    q, kv = torch.randn(1, 4, 8), torch.randn(1, 2, 8)
    fi.forward(q, kv, kv, new_kv_cache((4, 2, 4, 2, 8), F8, CPU), md, SPEC)
    (wrapper,) = fi._decode.values()
    with pytest.raises(ValueError, match="planned q torch.float32 / kv torch.float8_e4m3fn"):
        wrapper.run(q, torch.zeros(4, 2, 4, 2, 8))


# ---- the runner: allocation, probe, copies, prefix hits, graphs, draft model ----------------
def _runner(model, dtype, **kw) -> ModelRunner:
    return ModelRunner(model, CPU, dtype, 4, RuntimeConfig(), flashinfer_module=FakeFlashInfer,
                       kv_dtype=F8, **kw)  # fmt: skip


def test_the_runner_allocates_e4m3_pages_and_probes_them(bf16_model):
    runner = _runner(bf16_model, BF16)
    assert runner.backend.name == "flashinfer" and runner.kv_dtype == F8
    runner.allocate_kv_cache(16)
    m = bf16_model
    assert [c.dtype for c in runner.kv_caches] == [F8] * m.num_layers
    assert runner.kv_caches[0].shape == (16, 2, 4, m.num_kv_heads, m.head_dim)
    wrappers = [*runner.backend._decode.values(), *runner.backend._prefill.values()]
    assert wrappers and all(w.runs for w in wrappers)  # the probe ran decode and prefill
    assert {(p["q_dtype"], p["kv_dtype"]) for w in wrappers for p in w.plans} == {(BF16, F8)}


def test_a_runner_step_writes_the_e4m3_of_what_bf16_pages_hold(bf16_model):
    """Layer 0's K/V do not depend on attention: after the same prefill, the fp8 runner's
    layer-0 pages are the e4m3 of the bf16 runner's, byte for byte."""
    from engine.core.step_io import NewRequestData, SchedulerOutput
    from engine.sampling_params import SamplingParams

    runners = [_runner(bf16_model, BF16), ModelRunner(
        bf16_model, CPU, BF16, 4, RuntimeConfig(), flashinfer_module=FakeFlashInfer)]  # fmt: skip
    prompt = [3, 17, 42, 9, 11, 5, 8]
    for r in runners:
        r.allocate_kv_cache(8)
        new = NewRequestData("a", prompt, [], SamplingParams(max_tokens=2), [5, 2], 0)
        r.execute(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"a": 7},
                                  total_num_scheduled_tokens=7))  # fmt: skip
    fp8, bf16 = (r.kv_caches[0] for r in runners)
    assert (fp8.dtype, bf16.dtype) == (F8, BF16)
    assert bool(bf16[[5, 2]].abs().sum() > 0)
    assert torch.equal(page_bytes(fp8), page_bytes(to_fp8(bf16)))


def test_copy_on_write_copies_fp8_pages_byte_for_byte(bf16_model):
    runner = _runner(bf16_model, BF16)
    runner.allocate_kv_cache(8)
    for c in runner.kv_caches:
        page_bytes(c).copy_(torch.randint(0, 255, c.shape, dtype=torch.uint8))
    before = [page_bytes(c).clone() for c in runner.kv_caches]
    runner._copy_blocks([(1, 5), (2, 6)])
    for c, b in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(page_bytes(c)[5], b[1]) and torch.equal(page_bytes(c)[6], b[2])
        assert torch.equal(page_bytes(c)[:5], b[:5])


def test_a_prefix_hit_over_fp8_pages_reads_what_recomputing_reads(model):
    """Request 1 shares request 0's first two blocks (8 cached tokens, as a prefix-cache hit
    hands them out) and computes only its next token; request 0 continues with the same one."""
    run = PagedRun(model, fake_backend(), num_blocks=32, block_size=4, dtype=F8)
    prompt = [5, 9, 14, 3, 7, 22, 31, 8]
    last = run.step({0: prompt})[0][-1]
    nxt = int(last.argmax())
    run.tables[1], run.lens[1] = list(run.tables[0]), len(prompt)
    out = run.step({0: [nxt], 1: [nxt]})
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=0)
    assert run.tables[1][:2] == run.tables[0][:2] and run.tables[1][2] != run.tables[0][2]


def test_decode_graphs_over_fp8_pages_replay_what_eager_computes(model):
    run = PagedRun(model, fake_backend(), num_blocks=256, block_size=16, dtype=F8)
    gr = GraphRunner(
        model, run.backend, run.kv_caches, (1, 2, 4), CPU, block_size=16, max_blocks_per_seq=32,
        use_graphs=True, graph_factory=lambda body, pool: (ReplayGraph(body), pool), dtype=F32,
    )  # fmt: skip
    gr.capture()
    keys = {k for state in gr.graph_states.values() for k in state.wrappers}
    assert {(k.q_dtype, k.kv_dtype) for k in keys} == {(F32, F8)}
    report = check_graph_decode(gr, run, long_prompts(3), steps=4)
    assert report.failures() == [] and report.greedy_agreement == 1.0


def test_a_draft_model_keeps_its_kv_in_its_own_dtype(bf16_model):
    """The draft's cache is its own (its own backend, maybe torch): the target's fp8 pages
    do not change it, and KV sizing counts it at its dtype beside them."""
    from engine.worker.spec.draft_model import DraftModelProposer

    runner = _runner(bf16_model, BF16)
    runner.proposer = DraftModelProposer(bf16_model, CPU, BF16, 4, RuntimeConfig())
    runner.allocate_kv_cache(8)
    assert runner.kv_caches[0].dtype == F8 and runner.proposer.kv_caches[0].dtype == BF16
    runner.proposer.kv_caches[0][1] = 1.5
    runner._copy_blocks([(1, 3)])  # both caches, each in its own dtype
    assert bool((runner.proposer.kv_caches[0][3] == 1.5).all())
    geom = KVGeometry.of(bf16_model, 4, F8)
    assert runner.proposer.kv_bytes_per_block == 2 * geom.bytes_per_block  # bf16 vs 1 byte


# ---- sizing: the one KV-fit rule counts 1 byte per element ----------------------------------
def test_sizing_counts_one_byte_an_element_so_twice_the_blocks_fit():
    from engine.config import CacheConfig

    bf16 = KVGeometry(32, 16, 8, 128, BF16)
    fp8 = KVGeometry(32, 16, 8, 128, F8)
    assert (bf16.bytes_per_block, fp8.bytes_per_block) == (2 << 20, 1 << 20)  # Llama-3-8B
    cache = CacheConfig(memory_fraction=0.9)
    gib = 1 << 30
    args = (141 * gib, 17 * gib, 3 * gib)  # an H200: total, weights, activations
    assert num_blocks_for_gpu(cache, fp8, *args) // 2 == num_blocks_for_gpu(cache, bf16, *args)
    cpu = CacheConfig(cpu_kv_cache_gib=1.0)
    assert num_blocks_for_cpu(cpu, fp8) == 2 * num_blocks_for_cpu(cpu, bf16) == 1024


# ---- the KV tiers move fp8 pages as bytes ---------------------------------------------------
def test_the_kv_tiers_move_fp8_pages_byte_for_byte():
    from engine.worker.kv_tier.block_copier import BlockCopier
    from engine.worker.kv_tier.fingerprint import fingerprint_digest, fingerprint_fields
    from engine.worker.kv_tier.host_buffers import HostTierSlots, as_bytes, from_bytes

    caches = [new_kv_cache((6, 2, 4, 2, 8), F8, CPU) for _ in range(3)]
    for c in caches:
        c.copy_(to_fp8(10 * torch.randn(c.shape)))
    copier = BlockCopier(caches, CPU)
    slots = HostTierSlots(2, copier.block_shape, copier.dtype, pin=False)
    assert slots.buffer.dtype == F8
    assert slots.slot(0).numel() == KVGeometry(3, 4, 2, 8, F8).bytes_per_block
    copier.copy_out(2, slots.slot(0))
    payload = bytes(as_bytes(slots.slot(0)))  # what the disk tier writes
    back = from_bytes(memoryview(bytearray(payload)), F8, copier.block_shape)
    copier.copy_in(back, 4)
    assert all(torch.equal(page_bytes(c)[4], page_bytes(c)[2]) for c in caches)

    def digest(kv_dtype: str) -> bytes:
        return fingerprint_digest(fingerprint_fields(
            weights="w", model_config=ModelConfig(), run_dtype="bfloat16", kv_dtype=kv_dtype,
            block_size=4, num_layers=3, num_kv_heads=2, head_dim=8, tp_size=1, tp_rank=0,
        ))  # fmt: skip

    assert digest("fp8_e4m3") != digest("bfloat16")  # a disk tier never mixes the two


# ---- refusals at start, naming the key ------------------------------------------------------
def test_a_cpu_refuses_fp8_pages_at_start(tiny_llama_dir):
    from engine import LLM

    with pytest.raises(ConfigError, match=r"^cache\.kv_dtype: fp8 runs only on CUDA") as info:
        LLM(str(tiny_llama_dir), device="cpu", kv_cache_dtype="fp8_e4m3")
    assert info.value.key == "cache.kv_dtype"


def test_gpus_below_sm89_are_refused_and_ada_or_hopper_pass(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"^cache\.kv_dtype: fp8 needs compute capability"):
        check_kv_dtype("fp8_e4m3", cuda)
    for cap in ((8, 9), (9, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        check_kv_dtype("fp8_e4m3", cuda)  # wired: no refusal left on a capable GPU


def test_the_torch_backend_refuses_fp8_pages_naming_the_key():
    for setting, device in (("torch", CPU), ("auto", CPU)):
        with pytest.raises(ConfigError, match="fp8_e4m3 pages need the FlashInfer") as info:
            select_attention_backend(device, BF16, setting=setting, specs=[SPEC], kv_dtype=F8)
        assert info.value.key == "cache.kv_dtype"
    with pytest.raises(ConfigError, match=r"here the torch backend runs \(runtime.attention"):
        select_attention_backend(CPU, BF16, setting="torch", specs=[SPEC],
                                 flashinfer_module=FakeFlashInfer, kv_dtype=F8)  # fmt: skip


def test_a_runner_given_the_torch_backend_refuses_fp8_pages(model):
    with pytest.raises(ConfigError, match="given the torch one") as info:
        ModelRunner(model, CPU, F32, 4, RuntimeConfig(), backend=TorchPagedBackend(), kv_dtype=F8)
    assert info.value.key == "cache.kv_dtype"


def _plan_raises(self, *args, **kwargs):
    raise RuntimeError("ninja: build stopped: subcommand failed (batch_prefill)")


def test_a_failing_flashinfer_leaves_no_fallback_for_fp8_pages():
    failing = type("Failing", (FakeFlashInfer,), {
        "BatchDecodeWithPagedKVCacheWrapper": type("D", (_FakeWrapper,), {"plan": _plan_raises}),
        "BatchPrefillWithPagedKVCacheWrapper": type("P", (_FakePrefill,), {"plan": _plan_raises}),
    })  # fmt: skip
    kw = dict(specs=[SPEC], block_size=4, flashinfer_module=failing, kv_dtype=F8)
    with pytest.raises(ConfigError, match="which cannot run: .*ninja: build stopped") as info:
        select_attention_backend(CPU, BF16, setting="auto", **kw)
    assert info.value.key == "cache.kv_dtype"
    with pytest.raises(ConfigError, match="flashinfer cannot run here") as info:
        select_attention_backend(CPU, BF16, setting="flashinfer", **kw)
    assert info.value.key == "runtime.attention_backend"
    # The same module with pages in the model's dtype falls back, as before.
    kw["kv_dtype"] = None
    assert select_attention_backend(CPU, BF16, **kw).backend.name == "torch"
