"""GraphRunner on the CPU: static buffers, padding to buckets and slicing, with eager replay.

The padded step's attention metadata (views of the static buffers, padding rows, full-width
block tables for graphs) is checked first, then the runner end to end.

Every decode batch size around the bucket boundaries must give the hidden states, greedy
tokens and KV cache of unpadded eager execution, and padded rows must write nowhere. The
capture/replay bookkeeping (largest bucket first, one pool, plan before every replay) runs
with a stand-in graph that re-executes its body and the stand-in FlashInfer module.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import ModelConfig
from engine.worker.attention.base import ForwardContext
from engine.worker.attention.torch_paged import TorchPagedBackend
from engine.worker.decode_graphs import (
    GraphRunner,
    build_graph_runner,
    dummy_decode_metadata,
    padded_decode_metadata,
)
from engine.worker.models.loader import load_model
from graphs.buckets import PAD_BLOCK, PAD_SEQ_LEN, PAD_SLOT, StaticDecodeInputs
from tests.support.fake_flashinfer import fake_backend
from tests.support.fake_graphs import ReplayGraph
from tests.support.paged_harness import PagedRun, build_metadata

SIZES = (1, 2, 4, 8)
BLOCK = 4
MAX_BLOCKS = 16  # 64 tokens per request at most


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(ModelConfig(path=str(tiny_llama_dir)), torch.device("cpu")).model


def _prefilled(model, num_reqs: int) -> tuple[PagedRun, dict[int, int]]:
    """PagedRun with `num_reqs` prompts of different lengths prefilled; next token of each."""
    run = PagedRun(model, TorchPagedBackend(), num_blocks=128, block_size=BLOCK)
    prompts = {r: [(7 * r + j) % 200 + 3 for j in range(3 + 2 * r)] for r in range(num_reqs)}
    logits = run.step(prompts)
    return run, {r: int(lg[-1].argmax()) for r, lg in logits.items()}


def _decode_step(run: PagedRun, tokens: dict[int, int]) -> SimpleNamespace:
    """Allocate a slot for each request's next token; the step as the runner would build it."""
    seq_lens, tables = [], []
    for r in tokens:
        table, new_len = run.tables[r], run.lens[r] + 1
        while len(table) * BLOCK < new_len:
            table.append(run.free.pop())
        run.lens[r] = new_len
        seq_lens.append(new_len)
        tables.append(table)
    md = build_metadata([1] * len(tokens), seq_lens, tables, BLOCK)
    ids = torch.tensor(list(tokens.values()), dtype=torch.long)
    return SimpleNamespace(input_ids=ids, positions=md.positions, attn_metadata=md)


@torch.inference_mode()
def _eager(model, backend, step, caches) -> torch.Tensor:
    backend.begin_step(step.attn_metadata)
    ctx = ForwardContext(step.attn_metadata, caches, backend)
    return model(step.input_ids, step.positions, ctx)


# ---- the padded step's metadata -------------------------------------------------------------
def _small_step(seq_lens, tables, block_size=4):
    md = build_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
    ids = torch.arange(100, 100 + len(seq_lens))
    return ids, md


def test_padded_metadata_covers_the_bucket_with_padding_rows():
    buf = StaticDecodeInputs.allocate(8, max_blocks_per_seq=4, device="cpu")
    ids, md = _small_step([6, 3, 9], [[5, 2], [7], [1, 3, 4]])
    padded = padded_decode_metadata(buf, ids, md, bucket=4)
    assert buf.input_ids[:4].tolist() == [100, 101, 102, 0]
    assert buf.positions[:4].tolist() == [5, 2, 8, 0]
    # slots: 2*4+1, 7*4+2, 4*4+0, then padding writes nowhere
    assert buf.slot_mapping[:4].tolist() == [9, 30, 16, PAD_SLOT]
    assert buf.seq_lens[:4].tolist() == [6, 3, 9, PAD_SEQ_LEN]
    assert padded.block_tables.tolist() == [[5, 2, 0], [7, 0, 0], [1, 3, 4], [PAD_BLOCK] * 3]
    assert (padded.num_reqs, padded.num_tokens, padded.max_query_len) == (4, 4, 1)
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert padded.query_start_loc_cpu == [0, 1, 2, 3, 4]
    assert padded.seq_lens_cpu == [6, 3, 9, 1]
    assert padded.max_seq_len == 9 and padded.block_size == 4
    # Views of the static buffers, so a captured graph sees every step's values.
    assert padded.slot_mapping.data_ptr() == buf.slot_mapping.data_ptr()
    assert padded.block_tables.data_ptr() == buf.block_tables.data_ptr()


def test_full_width_metadata_exposes_every_static_column():
    buf = StaticDecodeInputs.allocate(4, max_blocks_per_seq=6, device="cpu")
    ids, md = _small_step([6], [[5, 2]])
    padded = padded_decode_metadata(buf, ids, md, bucket=2, full_width=True)
    assert padded.block_tables.shape == (2, 6)
    assert padded.block_tables[:, :2].tolist() == [[5, 2], [0, 0]]


def test_refill_with_a_smaller_batch_leaves_no_stale_rows_in_the_bucket():
    buf = StaticDecodeInputs.allocate(4, max_blocks_per_seq=4, device="cpu")
    ids, md = _small_step([6, 3, 9, 2], [[5, 2], [7], [1, 3, 4], [8]])
    padded_decode_metadata(buf, ids, md, bucket=4)
    ids, md = _small_step([7], [[5, 2]])
    padded = padded_decode_metadata(buf, ids, md, bucket=4)
    assert buf.slot_mapping.tolist() == [10, PAD_SLOT, PAD_SLOT, PAD_SLOT]
    assert padded.block_tables.tolist() == [[5, 2], [0, 0], [0, 0], [0, 0]]
    assert padded.seq_lens.tolist() == [7, 1, 1, 1]


def test_only_decode_steps_that_fit_are_padded():
    buf = StaticDecodeInputs.allocate(2, max_blocks_per_seq=2, device="cpu")
    md = build_metadata([2], [5], [[1, 2]], 4)
    with pytest.raises(ValueError, match="decode-only"):
        padded_decode_metadata(buf, torch.tensor([1, 2]), md, bucket=2)
    ids, md = _small_step([3, 3, 3], [[1], [2], [3]])
    with pytest.raises(ValueError, match="do not fit"):
        padded_decode_metadata(buf, ids, md, bucket=2)
    ids, md = _small_step([9], [[1, 2, 3]])
    with pytest.raises(ValueError, match="columns"):
        padded_decode_metadata(buf, ids, md, bucket=1)


def test_dummy_batch_is_all_padding():
    buf = StaticDecodeInputs.allocate(4, max_blocks_per_seq=3, device="cpu")
    md = dummy_decode_metadata(buf, 4, block_size=16)
    assert md.slot_mapping.tolist() == [PAD_SLOT] * 4
    assert md.seq_lens_cpu == [1, 1, 1, 1]
    assert md.block_tables.shape == (4, 3)
    assert md.is_decode_only


# ---- the runner ---------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 7, 8])
def test_padded_decode_equals_unpadded_at_every_bucket_boundary(model, batch):
    run, tokens = _prefilled(model, batch)
    step = _decode_step(run, tokens)
    ref_caches = [c.clone() for c in run.kv_caches]
    before = [c.clone() for c in run.kv_caches]
    expected = _eager(model, TorchPagedBackend(), step, ref_caches)

    gr = GraphRunner(
        model, TorchPagedBackend(), run.kv_caches, SIZES, torch.device("cpu"),
        block_size=BLOCK, max_blocks_per_seq=MAX_BLOCKS,
    )  # fmt: skip
    assert gr.can_run(step)
    got = gr.run(step)

    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    logits = model.compute_logits(got)
    assert logits.argmax(-1).tolist() == model.compute_logits(expected).argmax(-1).tolist()
    assert gr.stats.padded_rows == min(b for b in SIZES if b >= batch) - batch
    # The real tokens' K/V landed where eager put them; padding wrote nowhere else.
    slots = step.attn_metadata.slot_mapping
    written = torch.zeros(128 * BLOCK, dtype=torch.bool)
    written[slots] = True
    written = written.view(128, BLOCK)
    for got_c, ref_c, old_c in zip(run.kv_caches, ref_caches, before, strict=True):
        torch.testing.assert_close(got_c, ref_c, rtol=1e-5, atol=1e-5)
        untouched = ~written[:, None, :, None, None].expand_as(old_c)
        assert torch.equal(got_c[untouched], old_c[untouched])


def test_greedy_generation_through_buckets_equals_eager(model):
    """Batches shrink as requests finish, crossing buckets 8 -> 4 -> 2 -> 1."""
    eager_run, eager_tok = _prefilled(model, 7)
    graph_run, graph_tok = _prefilled(model, 7)
    assert eager_tok == graph_tok
    gr = GraphRunner(
        model, TorchPagedBackend(), graph_run.kv_caches, SIZES, torch.device("cpu"),
        block_size=BLOCK, max_blocks_per_seq=MAX_BLOCKS,
    )  # fmt: skip
    eager_out = {r: [t] for r, t in eager_tok.items()}
    graph_out = {r: [t] for r, t in graph_tok.items()}
    for live in (7, 7, 5, 4, 3, 2, 1, 1):
        for run, out, use_graph in ((eager_run, eager_out, False), (graph_run, graph_out, True)):
            step = _decode_step(run, {r: out[r][-1] for r in range(live)})
            if use_graph:
                hidden = gr.run(step)
            else:
                hidden = _eager(model, run.backend, step, run.kv_caches)
            for r, tok in enumerate(model.compute_logits(hidden).argmax(-1).tolist()):
                out[r].append(tok)
    assert graph_out == eager_out
    assert gr.stats.replays == 8


def test_can_run_only_decode_steps_that_fit(model):
    gr = GraphRunner(
        model, TorchPagedBackend(), [], SIZES, torch.device("cpu"),
        block_size=BLOCK, max_blocks_per_seq=2,
    )  # fmt: skip

    def step(q_lens, seq_lens, tables):
        md = build_metadata(q_lens, seq_lens, tables, BLOCK)
        return SimpleNamespace(input_ids=None, positions=md.positions, attn_metadata=md)

    assert gr.can_run(step([1, 1], [3, 5], [[1], [2, 3]]))
    assert not gr.can_run(step([3], [3], [[1]]))  # prefill
    assert not gr.can_run(step([1, 2], [3, 5], [[1], [2, 3]]))  # mixed
    assert not gr.can_run(step([1] * 9, [1] * 9, [[i] for i in range(9)]))  # > largest bucket
    assert not gr.can_run(step([1], [9], [[1, 2, 3]]))  # wider than the static table


def test_graph_mode_needs_cuda_or_a_factory_and_a_graph_safe_backend(model):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA device"):
        GraphRunner(model, fake_backend(), [], SIZES, cpu, block_size=4, max_blocks_per_seq=4,
                    use_graphs=True)  # fmt: skip
    with pytest.raises(ValueError, match="graph-safe"):
        GraphRunner(model, TorchPagedBackend(), [], SIZES, cpu, block_size=4,
                    max_blocks_per_seq=4, use_graphs=True, graph_factory=lambda b, p: (b, p))  # fmt: skip


def test_capture_largest_first_and_replay_after_plan_with_flashinfer_hooks(model):
    """The GPU control flow on the CPU: stand-in graphs and the stand-in FlashInfer module."""
    captured, pools = [], []

    def factory(body, pool):
        graph = ReplayGraph(body)
        captured.append(graph)
        pools.append(pool)
        return graph, pool or "shared-pool"

    run, tokens = _prefilled(model, 5)
    backend = fake_backend()
    gr = GraphRunner(
        model, backend, run.kv_caches, SIZES, torch.device("cpu"), block_size=BLOCK,
        max_blocks_per_seq=MAX_BLOCKS, use_graphs=True, graph_factory=factory,
    )  # fmt: skip
    step = _decode_step(run, tokens)
    assert not gr.can_run(step)  # nothing captured yet
    stats = gr.capture()
    assert stats.captured_sizes == list(SIZES)
    assert [g for g in gr.graphs] == [8, 4, 2, 1]  # captured largest first
    assert pools == [None, "shared-pool", "shared-pool", "shared-pool"]
    assert gr.can_run(step)

    ref_caches = [c.clone() for c in run.kv_caches]
    expected = _eager(model, TorchPagedBackend(), step, ref_caches)
    got = gr.run(step)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert gr.graphs[8].replays == 1 and gr.graphs[4].replays == 0
    state = gr.graph_states[8]
    seq_lens = step.attn_metadata.seq_lens_cpu
    assert state.last_page_len_buf.tolist() == [(s - 1) % BLOCK + 1 for s in seq_lens] + [1] * 3
    for wrapper in state.wrappers.values():
        assert wrapper.use_cuda_graph
        assert len(wrapper.plans) == 3  # warm-up, capture, this replay
    for got_c, ref_c in zip(run.kv_caches, ref_caches, strict=True):
        torch.testing.assert_close(got_c, ref_c, rtol=1e-5, atol=1e-5)


def test_build_graph_runner_says_no_without_cuda_or_a_graph_safe_backend(model):
    kw = dict(sizes=None, block_size=4, max_num_seqs=8, max_model_len=64)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert build_graph_runner(model, fake_backend(), [], cpu, enabled=True, **kw) is None
    assert build_graph_runner(model, fake_backend(), [], cuda, enabled=False, **kw) is None
    torch_backend = TorchPagedBackend()
    assert build_graph_runner(model, torch_backend, [], cuda, enabled=True, **kw) is None
