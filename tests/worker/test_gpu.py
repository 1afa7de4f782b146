"""GPU checks (skipped without CUDA): FlashInfer vs the torch backend, graph replay vs eager,
greedy fidelity against transformers in bf16. scripts/gpu_check.sh runs them on the H200.

Every FlashInfer kernel family used here (bf16, head_dim 128, with and without a sliding
window) is the one bench/gpu_decode.py builds, so the JIT compiles happen once per machine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.worker.attention.base import AttentionLayerSpec
from engine.worker.attention.torch_paged import TorchPagedBackend
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


def _prompts(n: int) -> dict[int, list[int]]:
    return {r: [(11 * r + j) % 400 + 3 for j in range(5 + 9 * r)] for r in range(n)}


def _new_run(model, backend) -> PagedRun:
    return PagedRun(model, backend, num_blocks=256, block_size=BLOCK, dtype=torch.bfloat16,
                    device=CUDA)  # fmt: skip


def _eager_greedy(model, backend, n: int, steps: int) -> dict[int, list[int]]:
    """Prefill n prompts, then `steps` decode steps; the batch shrinks by one each step."""
    run = _new_run(model, backend)
    toks = {r: [int(lg[-1].argmax())] for r, lg in run.step(_prompts(n)).items()}
    for s in range(steps):
        live = range(max(1, n - s))
        for r, lg in run.step({r: toks[r][-1:] for r in live}).items():
            toks[r].append(int(lg[-1].argmax()))
    return toks


def test_cuda_graph_replay_equals_eager_tokens(tiny_gpu_model, flashinfer_backend):
    from engine.worker.decode_graphs import GraphRunner

    _, model = tiny_gpu_model
    eager = _eager_greedy(model, flashinfer_backend, 9, 10)
    # Same prompts through graphs: prefill eagerly, then every decode step replays a graph.
    run = _new_run(model, flashinfer_backend)
    gr = GraphRunner(model, flashinfer_backend, run.kv_caches, (1, 2, 4, 8, 16), CUDA,
                     block_size=BLOCK, max_blocks_per_seq=16)  # fmt: skip
    stats = gr.capture()
    assert stats.captured_sizes == [1, 2, 4, 8, 16]
    toks = {r: [int(lg[-1].argmax())] for r, lg in run.step(_prompts(9)).items()}
    for s in range(10):
        live = {r: toks[r][-1] for r in range(max(1, 9 - s))}
        seq_lens, tables = [], []
        for r in live:
            table, run.lens[r] = run.tables[r], run.lens[r] + 1
            while len(table) * BLOCK < run.lens[r]:
                table.append(run.free.pop())
            seq_lens.append(run.lens[r])
            tables.append(table)
        md = build_metadata([1] * len(live), seq_lens, tables, BLOCK, device=CUDA)
        ids = torch.tensor(list(live.values()), device=CUDA)
        step = SimpleNamespace(input_ids=ids, positions=md.positions, attn_metadata=md)
        assert gr.can_run(step)
        hidden = gr.run(step)
        for r, t in zip(live, model.compute_logits(hidden).argmax(-1).tolist(), strict=True):
            toks[r].append(t)
    assert toks == eager
    assert gr.stats.replays == 10


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


def test_engine_picks_flashinfer_on_cuda(tiny_gpu_model, flashinfer_backend):
    from engine import LLM

    path, _ = tiny_gpu_model
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=256, block_size=BLOCK,
              num_kv_blocks=512)  # fmt: skip
    assert llm.engine.runner.backend.name == "flashinfer"
