"""The graph-correctness comparison (tests/support/graph_equality.py) on the CPU.

The CUDA test in test_gpu.py runs it on real graphs and FlashInfer; here stand-in graphs
(re-running the body) and the stand-in FlashInfer module show that it passes a correct
replay with contexts over 128 tokens and every bucket, and that it fails a replay whose
output differs from eager by one ulp, or by enough to change tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.worker.decode_graphs import GraphRunner
from engine.worker.models.loader import load_model
from tests.support.fake_flashinfer import fake_backend
from tests.support.fake_graphs import ReplayGraph
from tests.support.graph_equality import GraphEquality, check_graph_decode, long_prompts
from tests.support.paged_harness import PagedRun

CPU = torch.device("cpu")
BLOCK = 16
SIZES = (1, 2, 4, 8, 16)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(ModelConfig(path=str(tiny_llama_dir)), CPU).model


def _graph_runner(model, run: PagedRun, after_replay=None) -> GraphRunner:
    holder: dict[str, GraphRunner] = {}

    class Graph(ReplayGraph):
        def replay(self) -> None:
            super().replay()
            if after_replay is not None:
                after_replay(holder["gr"].hidden)

    gr = GraphRunner(
        model, run.backend, run.kv_caches, SIZES, CPU, block_size=BLOCK, max_blocks_per_seq=32,
        use_graphs=True, graph_factory=lambda body, pool: (Graph(body), pool),
    )  # fmt: skip
    holder["gr"] = gr
    gr.capture()
    return gr


def _check(model, after_replay=None, num_reqs: int = 9, steps: int = 12) -> GraphEquality:
    run = PagedRun(model, fake_backend(), num_blocks=256, block_size=BLOCK)
    gr = _graph_runner(model, run, after_replay)
    return check_graph_decode(gr, run, long_prompts(num_reqs), steps=steps)


def test_a_correct_replay_passes_over_every_bucket(model):
    report = _check(model)
    assert report.failures() == []
    assert (report.steps, report.rows) == (12, 9 + 8 + 7 + 6 + 5 + 4 + 3 + 2 + 1 + 1 + 1 + 1)
    assert report.buckets == set(SIZES)
    assert report.greedy_agreement == 1.0 and report.unequal_replays == []


def test_a_replay_one_ulp_off_eager_fails_the_equality(model):
    def nudge(hidden):
        hidden[0, 0] = torch.nextafter(hidden[0, 0], torch.tensor(float("inf")))

    report = _check(model, nudge, num_reqs=3, steps=4)
    assert report.unequal_replays == [1, 2, 3, 4]
    assert report.failures()[0].startswith("replay != padded eager at steps [1, 2")
    assert report.max_logit_excess <= 1.0  # within tolerance of unpadded eager all the same


def _swap_first_two_rows(hidden):
    hidden[:2] = hidden[:2].flip(0).clone()  # each of two requests gets the other's output


def _nan(hidden):
    hidden[0, 0] = float("nan")


@pytest.mark.parametrize("corrupt", [_swap_first_two_rows, _nan], ids=["swapped", "nan"])
def test_a_replay_far_from_eager_fails_the_logit_tolerance(model, corrupt):
    report = _check(model, corrupt, num_reqs=3, steps=2)
    assert report.max_logit_excess > 1.0
    assert any("logits differ" in f for f in report.failures())


def test_greedy_agreement_threshold_is_95_percent():
    assert GraphEquality(rows=100, greedy_agreed=95).failures() == []
    assert GraphEquality(rows=100, greedy_agreed=94).failures() == ["greedy agreement 94.0% < 95%"]
