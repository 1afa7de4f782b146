"""GPU checks (skipped without CUDA): FlashInfer vs the torch backend, the start-up probe,
graph replays against eager (tests/support/graph_equality.py, whose logic
tests/worker/test_graph_equality.py checks on the CPU), greedy fidelity against transformers
in bf16, embeddings (prefill-only, pooled on the device) against sentence-transformers, the
KV tiers' copy stream, pinned buffers and greedy output (issue 30), and fp8 KV pages
(`fp8_pages`: backend, graphs, engine, KV tier; issue 26).
scripts/gpu_check.sh runs them on the H200.

Every FlashInfer kernel family used here (bf16, head_dim 128, with and without a sliding
window) is the one bench/gpu_decode.py builds, so the JIT compiles happen once per machine;
the fp8-page tests use the FA2 prefill modules over e4m3 pages, which the fp8 phase builds
(bench/gpu_fp8_kv.py) or, when it did not run, the first of them builds.
"""

from __future__ import annotations

import pytest
import torch

from engine.worker.attention.base import AttentionLayerSpec
from engine.worker.attention.torch_paged import TorchPagedBackend
from tests.support.graph_equality import check_graph_decode, long_prompts
from tests.support.paged_harness import PagedRun, build_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = torch.device("cuda")
BLOCK = 16
TINY_128 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128)  # fmt: skip


@pytest.fixture(scope="module")
def flashinfer_backend():
    from engine.worker.attention.flashinfer import FlashInferBackend, FlashInferUnavailable

    try:
        return FlashInferBackend(CUDA)
    except FlashInferUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tiny_gpu_model(tiny_checkpoint):
    from engine.config import ModelConfig
    from engine.worker.models.loader import load_model

    path = tiny_checkpoint("llama", **TINY_128)
    return path, load_model(ModelConfig(path=str(path), dtype="bfloat16"), CUDA).model


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [([37, 1, 1, 20], [37, 130, 17, 64]), ([1, 1, 1, 1, 1], [37, 130, 17, 64, 1])],
    ids=["mixed", "decode"],
)
def test_flashinfer_matches_torch_backend(flashinfer_backend, q_lens, seq_lens, window):
    gen = torch.Generator(device=CUDA).manual_seed(0)
    spec = AttentionLayerSpec(32, 8, 128, 128**-0.5, sliding_window=window)
    perm = torch.randperm(64).tolist()
    tables = [[perm.pop() for _ in range(-(-s // BLOCK))] for s in seq_lens]
    md = build_metadata(q_lens, seq_lens, tables, BLOCK, device=CUDA)
    t = md.num_tokens
    base = torch.randn(64, 2, BLOCK, 8, 128, generator=gen, device=CUDA).bfloat16()
    q = torch.randn(t, 32, 128, generator=gen, device=CUDA).bfloat16()
    k = torch.randn(t, 8, 128, generator=gen, device=CUDA).bfloat16()
    v = torch.randn(t, 8, 128, generator=gen, device=CUDA).bfloat16()
    caches = {}
    outs = {}
    for name, backend in (("torch", TorchPagedBackend()), ("flashinfer", flashinfer_backend)):
        caches[name] = base.clone()
        backend.begin_step(md)
        outs[name] = backend.forward(q, k, v, caches[name], md, spec).float()
    assert torch.equal(caches["torch"], caches["flashinfer"])
    torch.testing.assert_close(outs["flashinfer"], outs["torch"], rtol=2e-2, atol=2e-2)


def _new_run(model, backend) -> PagedRun:
    return PagedRun(model, backend, num_blocks=256, block_size=BLOCK, dtype=torch.bfloat16,
                    device=CUDA)  # fmt: skip


def test_graph_replays_equal_padded_eager_and_track_unpadded_eager(
    tiny_gpu_model, flashinfer_backend
):
    """Not bit-identical tokens against unpadded eager (other GEMM kernels for 9 rows than for
    a 16-row bucket; graph-mode FlashInfer always splits KV): each replay equals eager on the
    same padded buffers through the same graph-mode wrappers, and stays within a logit
    tolerance of unpadded eager with >= 95 % greedy agreement. Contexts are 130..266 tokens,
    so split-KV really splits."""
    from engine.worker.decode_graphs import GraphRunner

    _, model = tiny_gpu_model
    run = _new_run(model, flashinfer_backend)
    gr = GraphRunner(model, flashinfer_backend, run.kv_caches, (1, 2, 4, 8, 16), CUDA,
                     block_size=BLOCK, max_blocks_per_seq=32)  # fmt: skip
    assert gr.capture().captured_sizes == [1, 2, 4, 8, 16]
    report = check_graph_decode(gr, run, long_prompts(9), steps=12)
    print("graph equality:", report.as_dict())  # the figures, for docs/gpu.md
    assert report.failures() == [], report.as_dict()
    assert report.buckets == {1, 2, 4, 8, 16}
    assert gr.stats.replays == 12


def test_start_up_probe_passes_with_llama_3_8b_heads():
    """The probe runtime.attention_backend runs at start-up, on the real FlashInfer: a GQA
    group of 4 (tensor-core decode), head_dim 128, bf16, FA2 prefill."""
    from engine.worker.attention.selection import select_attention_backend

    spec = AttentionLayerSpec(32, 8, 128, 128**-0.5)
    choice = select_attention_backend(CUDA, torch.bfloat16, setting="auto", specs=[spec],
                                      block_size=BLOCK)  # fmt: skip
    assert choice.fallback_reason is None
    assert choice.backend.name == "flashinfer"


def test_greedy_fidelity_vs_transformers_bf16(tiny_gpu_model):
    """Teacher-forced: at each of our greedy tokens, transformers (bf16, same weights) must rank
    it first or within a bf16-sized margin of its own first choice."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams

    path, _ = tiny_gpu_model
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=256, block_size=BLOCK,
              num_kv_blocks=512)  # fmt: skip
    prompts = [[3, 17, 42, 9, 100], [5, 6, 7], [11] * 30, list(range(40, 90))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(CUDA).eval()
    exact = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        ids = torch.tensor([prompt + ours], device=CUDA)
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()  # predicts each of ours
        top = logits.max(-1).values
        chosen = logits.gather(1, torch.tensor(ours, device=CUDA)[:, None]).squeeze(1)
        gap = top - chosen  # 0 where transformers agrees exactly
        spread = logits.std(-1)
        assert bool((gap <= 0.05 * spread + 0.02).all()), (gap.tolist(), spread.tolist())
        exact += int((gap == 0).sum())
        total += len(ours)
    assert exact / total >= 0.9


def test_engine_picks_flashinfer_and_graphs_on_cuda(tiny_gpu_model, flashinfer_backend):
    from engine import LLM

    path, _ = tiny_gpu_model
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=256, block_size=BLOCK,
              num_kv_blocks=512)  # fmt: skip
    acc = llm.engine.accelerator
    assert (acc.attention_backend, acc.decode_graphs, acc.fallbacks()) == ("flashinfer", True, {})
    assert llm.engine.runner.backend.name == "flashinfer"


def embedding_fidelity(device: str) -> str:
    """LLM.embed in bf16 on `device` against sentence-transformers (float32, CPU) on a tiny
    mean-pooled, normalized qwen3 embedder with head_dim 128 (the FlashInfer kernel family
    above), prompts chunked over 8-token steps so the running sum crosses steps; returns the
    attention backend that ran. A bf16 vector is within 1e-2 and cosine 0.999 of the
    reference (on the CPU: 3e-3 and 0.9999), while the same prompts last-token pooled are
    not, so a swapped pooling method fails. Called with "cpu" it checks the same on the CPU."""
    import tempfile
    from pathlib import Path

    from engine import LLM
    from tests.support.tiny_embedders import make_tiny_embedder, st_encode, st_pooled_unnormalized

    texts = ["The capital of France is Paris.", "a", "Hello, how are you today?",
             "Once upon a time there was a little girl who lived in a village near the forest."]  # fmt: skip
    path = make_tiny_embedder(Path(tempfile.mkdtemp()) / "qwen3-mean", "qwen3", "mean", **TINY_128)
    ref = st_encode(path, texts)
    unit, cos = torch.nn.functional.normalize, torch.nn.functional.cosine_similarity
    wrong = unit(st_pooled_unnormalized(path, texts, "last"), dim=1)
    assert float(cos(wrong, ref, dim=1).min()) < 0.99  # the check tells the methods apart
    llm = LLM(str(path), dtype="bfloat16", device=device, max_model_len=256, block_size=BLOCK,
              num_kv_blocks=64, max_num_batched_tokens=8)  # fmt: skip
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    assert ours.shape == ref.shape
    assert float(cos(ours, ref, dim=1).min()) >= 0.999
    assert float((ours - ref).abs().max()) < 1e-2
    assert float((ours.norm(dim=1) - 1).abs().max()) < 1e-3
    return llm.engine.runner.backend.name


def test_embeddings_on_cuda_equal_sentence_transformers(flashinfer_backend):
    assert embedding_fidelity("cuda") == "flashinfer"


def test_kv_tier_copies_run_on_a_copy_stream_into_pinned_buffers():
    """issue 30 on CUDA: host slots and staging buffers are pinned; a save waits for the
    compute stream's writes (the fence) on the tier's own stream, from the worker thread,
    and a load written back reads equal."""
    import threading

    from engine.worker.kv_tier.block_copier import BlockCopier
    from engine.worker.kv_tier.host_buffers import HostTierSlots, StagingBuffers

    caches = [torch.zeros(8, 2, BLOCK, 2, 128, device=CUDA, dtype=torch.bfloat16)
              for _ in range(3)]  # fmt: skip
    copier = BlockCopier(caches, CUDA)
    slots = HostTierSlots(2, copier.block_shape, copier.dtype, pin=True)
    staging = StagingBuffers(1, copier.block_shape, copier.dtype, pin=True)
    assert slots.buffer.is_pinned() and staging.acquire(0).is_pinned()
    src = [torch.randn(copier.block_shape[1:]).to(torch.bfloat16) for _ in caches]
    big = torch.randn(4096, 4096, device=CUDA)
    for _ in range(8):  # the block's last writes queue behind slow kernels
        big = big @ big / 64
    for c, s in zip(caches, src, strict=True):
        c[3].copy_(s.to(CUDA) + (big[0, 0] * 0).to(c.dtype))
    fence = copier.fence()
    t = threading.Thread(target=copier.copy_out, args=(3, slots.slot(0), fence))
    t.start()
    t.join()
    assert copier._stream is not None and copier._stream != torch.cuda.current_stream()
    for layer in range(3):
        assert torch.equal(slots.slot(0)[layer], src[layer])
    copier.copy_in(slots.slot(0), 5)
    torch.cuda.current_stream().synchronize()
    assert all(torch.equal(c[5], c[3]) for c in caches)


def test_kv_tier_greedy_is_identical_on_cuda_with_host_and_disk_tiers(tiny_gpu_model, tmp_path):
    """issue 30 on CUDA: a pool too small for four conversations, a host tier of pinned slots
    and a disk tier behind it; returning turns are served from the tiers, output unchanged."""
    from engine import LLM, SamplingParams

    path, _ = tiny_gpu_model
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    firsts = [[(i * 37 + 11 * j) % 400 + 5 for j in range(70)] for i in range(4)]  # vocab 512

    def turns(llm: LLM) -> list[list[int]]:
        out = []
        for p in firsts + [f + [5, 6, 7, 8] for f in firsts]:
            out.append(llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
                       .outputs[0].token_ids)  # fmt: skip
        return out

    small = dict(dtype="bfloat16", device="cuda", max_model_len=128, block_size=BLOCK,
                 num_kv_blocks=10)  # fmt: skip
    want = turns(LLM(str(path), **small))
    llm = LLM(str(path), **small, host_tier_gib=0.01, disk_tier_dir=str(tmp_path / "tier"))
    assert llm.engine.kv_tier.host is not None
    assert turns(llm) == want
    st = llm.engine.stats().kv_tier
    assert st.hit_tokens["host"] + st.hit_tokens["disk"] >= 2 * 64  # two evicted at least
    assert st.bytes_written["host"] > 0 and st.bytes_written["disk"] > 0


# ---- fp8 KV pages (cache.kv_dtype: fp8_e4m3; the fp8kv phase) --------------------------------
@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [([37, 1, 1, 20], [37, 130, 17, 64]), ([1, 1, 1, 1, 1], [37, 130, 17, 64, 1])],
    ids=["mixed", "decode"],
)
def test_fp8_pages_read_as_the_torch_backend_reads_their_values(
    flashinfer_backend, q_lens, seq_lens
):
    """Llama-3-8B's heads (tensor-core decode), contexts past split-KV: FlashInfer over e4m3
    pages equals the torch backend over the same values in bf16 within the bf16 tolerance
    of the test above, the pages are the e4m3 of the reference's cache byte for byte, and
    the output stays within the fp8 tolerance of bf16 pages (0.25, test_fp8_kv_pages.py;
    0.139 measured at these shapes and seeds 0-2 on the CPU, float32, with the stand-in)."""
    from engine.worker.attention.kv_dtype import page_bytes, to_fp8

    gen = torch.Generator(device=CUDA).manual_seed(0)
    spec = AttentionLayerSpec(32, 8, 128, 128**-0.5)
    perm = torch.randperm(64).tolist()
    tables = [[perm.pop() for _ in range(-(-s // BLOCK))] for s in seq_lens]
    md = build_metadata(q_lens, seq_lens, tables, BLOCK, device=CUDA)
    t = md.num_tokens
    base = torch.randn(64, 2, BLOCK, 8, 128, generator=gen, device=CUDA).bfloat16()
    q, k, v = (torch.randn(t, h, 128, generator=gen, device=CUDA).bfloat16() for h in (32, 8, 8))
    pages = to_fp8(base)
    flashinfer_backend.begin_step(md)
    got = flashinfer_backend.forward(q, k, v, pages, md, spec).float()
    ref_cache = pages.bfloat16()
    ref_backend = TorchPagedBackend()
    ref_backend.begin_step(md)
    kr, vr = to_fp8(k).bfloat16(), to_fp8(v).bfloat16()
    ref = ref_backend.forward(q, kr, vr, ref_cache, md, spec).float()
    assert torch.equal(page_bytes(pages), page_bytes(to_fp8(ref_cache)))
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    ref_backend.begin_step(md)
    full = ref_backend.forward(q, k, v, base.clone(), md, spec).float()
    print("fp8 pages vs bf16 pages, max abs:", float((got - full).abs().max()))
    assert float((got - full).abs().max()) <= 0.25


def test_fp8_pages_under_decode_graphs_replay_as_padded_eager(tiny_gpu_model, flashinfer_backend):
    """The graph test above over e4m3 pages: graph wrappers planned for bf16 queries and
    fp8 pages, replays equal to eager on the same padded buffers."""
    from engine.worker.decode_graphs import GraphRunner

    _, model = tiny_gpu_model
    run = PagedRun(model, flashinfer_backend, num_blocks=256, block_size=BLOCK,
                   dtype=torch.float8_e4m3fn, device=CUDA)  # fmt: skip
    gr = GraphRunner(model, flashinfer_backend, run.kv_caches, (1, 2, 4, 8, 16), CUDA,
                     block_size=BLOCK, max_blocks_per_seq=32, dtype=torch.bfloat16)  # fmt: skip
    assert gr.capture().captured_sizes == [1, 2, 4, 8, 16]
    keys = {k for state in gr.graph_states.values() for k in state.wrappers}
    assert {(k.q_dtype, k.kv_dtype) for k in keys} == {(torch.bfloat16, torch.float8_e4m3fn)}
    report = check_graph_decode(gr, run, long_prompts(9), steps=12)
    print("graph equality over fp8 pages:", report.as_dict())
    assert report.failures() == [], report.as_dict()


def test_fp8_pages_served_by_the_engine_with_graphs_and_twice_the_blocks(tiny_gpu_model):
    """LLM with kv_cache_dtype fp8_e4m3: FlashInfer with decode graphs over e4m3 caches,
    KV sizing at the same memory fraction (0.05: a few GB, so the pool stays small) gives
    about twice the blocks (weights and activations take the same share), and greedy output
    tracks bf16 pages: where it differs, the bf16 run's top-2 margin there is small (the
    tiny model's std-0.15 weights make margins of whole nats common)."""
    import gc

    from engine import LLM, SamplingParams

    path, _ = tiny_gpu_model
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in
               ([3, 17, 42, 9, 100], [5, 6, 7], [11] * 30, list(range(40, 90)))]  # fmt: skip
    outs, blocks = {}, {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=256,
                  block_size=BLOCK, memory_fraction=0.05, kv_cache_dtype=kv)  # fmt: skip
        acc = llm.engine.accelerator
        assert (acc.attention_backend, acc.decode_graphs) == ("flashinfer", True), acc
        runner = llm.engine.runner
        want = torch.float8_e4m3fn if kv != "auto" else torch.bfloat16
        assert {c.dtype for c in runner.kv_caches} == {want}
        blocks[kv] = llm.engine.stats().num_blocks
        outs[kv] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    print("KV blocks at memory_fraction 0.05:", blocks)
    assert 1.8 < blocks["fp8_e4m3"] / blocks["auto"] < 2.2
    for ref, got in zip(outs["auto"], outs["fp8_e4m3"], strict=True):
        pairs = enumerate(zip(ref.token_ids, got.token_ids, strict=True))
        i = next((j for j, (a, b) in pairs if a != b), None)
        if i is not None:
            top = ref.logprobs[i].top
            assert top[0][1] - top[1][1] < 0.5, (i, top)


def test_fp8_pages_cross_the_tier_copy_stream_byte_for_byte():
    """The copy stream moves e4m3 pages as it moves bf16 ones (a copy of bytes)."""
    from engine.worker.attention.kv_dtype import new_kv_cache, page_bytes, to_fp8
    from engine.worker.kv_tier.block_copier import BlockCopier
    from engine.worker.kv_tier.host_buffers import HostTierSlots

    caches = [new_kv_cache((8, 2, BLOCK, 2, 128), torch.float8_e4m3fn, CUDA) for _ in range(3)]
    for c in caches:
        c.copy_(to_fp8(torch.randn(c.shape, device=CUDA) * 8))
    copier = BlockCopier(caches, CUDA)
    slots = HostTierSlots(1, copier.block_shape, copier.dtype, pin=True)
    copier.copy_out(3, slots.slot(0), copier.fence())
    copier.copy_in(slots.slot(0), 6)
    torch.cuda.current_stream().synchronize()
    assert all(torch.equal(page_bytes(c)[6], page_bytes(c)[3]) for c in caches)
