"""Decode-graph correctness, the comparison the CUDA test and its CPU check share.

Bit-identical tokens between a padded graph replay and an unpadded eager step are not a
property a GPU has: cuBLAS picks other kernels for 9 rows than for a 16-row bucket, and
FlashInfer's graph-mode wrappers always take the split-KV path. What does hold, per decode
step (teacher-forced: every step feeds the replay's greedy tokens):

  1. replay == eager on the same padded buffers through the same graph-mode wrappers
     (`torch.equal` over the whole bucket): the graph recorded what eager runs;
  2. replay ~ unpadded eager (the ordinary wrappers, no padding): each logit within
     `LOGIT_ATOL + LOGIT_RTOL * std(row)`, and greedy tokens agreeing on >= 95 % of rows.

Per step, the unpadded eager forward runs first, then the replay, then the padded eager
forward: the last two write the same K/V, so the cache always holds the graph path's.
On the CPU a stand-in graph re-runs its body, so (1) is exact by construction there; the CPU
test checks that the comparison itself catches a replay that differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from engine.worker.attention.base import ForwardContext
from engine.worker.decode_graphs import GraphRunner, padded_decode_metadata
from graphs.buckets import pick_bucket
from tests.support.paged_harness import PagedRun, build_metadata

# bf16 logits after a few layers: a different GEMM tiling moves them by a few bf16 ulps of
# the hidden state; a wrong page, padding row leaking or stale plan moves them by O(std).
LOGIT_ATOL = 0.02
LOGIT_RTOL = 0.05
MIN_GREEDY_AGREEMENT = 0.95


@dataclass
class GraphEquality:
    """Totals over the decode steps compared."""

    steps: int = 0
    rows: int = 0
    unequal_replays: list[int] = field(default_factory=list)  # step numbers failing (1)
    greedy_agreed: int = 0
    max_logit_diff: float = 0.0
    max_logit_excess: float = 0.0  # max |diff| / (atol + rtol * std): <= 1 passes (2)
    buckets: set[int] = field(default_factory=set)

    @property
    def greedy_agreement(self) -> float:
        return self.greedy_agreed / self.rows if self.rows else 1.0

    def failures(self) -> list[str]:
        """Why the graphs are not correct; empty when they are."""
        out = []
        if self.unequal_replays:
            out.append(f"replay != padded eager at steps {self.unequal_replays}")
        if self.max_logit_excess > 1.0:
            out.append(
                f"logits differ from unpadded eager by up to {self.max_logit_diff:.3g} "
                f"({self.max_logit_excess:.2f}x the tolerance)"
            )
        if self.greedy_agreement < MIN_GREEDY_AGREEMENT:
            out.append(f"greedy agreement {self.greedy_agreement:.1%} < {MIN_GREEDY_AGREEMENT:.0%}")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps, "rows": self.rows, "buckets": sorted(self.buckets),
            "unequal_replays": self.unequal_replays,
            "greedy_agreement": round(self.greedy_agreement, 4),
            "max_logit_diff": self.max_logit_diff,
            "max_logit_excess": round(self.max_logit_excess, 3),
        }  # fmt: skip


@torch.inference_mode()
def compare_decode_step(gr: GraphRunner, model: Any, step: Any, report: GraphEquality) -> list[int]:
    """Run one decode step three ways (see the module docstring), add it to `report`; the
    replay's greedy tokens."""
    md = step.attn_metadata
    n = md.num_reqs
    bucket = pick_bucket(gr.sizes, n)
    backend, caches = gr.backend, gr.kv_caches
    backend.begin_step(md)  # unpadded eager, ordinary wrappers
    unpadded = model.compute_logits(
        model(step.input_ids, step.positions, ForwardContext(md, caches, backend))
    ).float()
    gr.run(step)
    replay = gr.hidden[:bucket].clone()
    padded = padded_decode_metadata(gr.buffers, step.input_ids, md, bucket, gr.use_graphs)
    if gr.use_graphs:
        backend.begin_graph_step(gr.graph_states[bucket], padded)  # the graph-mode wrappers
    else:
        backend.begin_step(padded)
    ids, pos = gr.buffers.input_ids[:bucket], gr.buffers.positions[:bucket]
    eager = model(ids, pos, ForwardContext(padded, caches, backend))
    report.steps += 1
    report.buckets.add(bucket)
    if not torch.equal(replay, eager):
        report.unequal_replays.append(report.steps)
    logits = model.compute_logits(replay[:n]).float()
    diff = (logits - unpadded).abs().amax(-1).nan_to_num(nan=float("inf"))  # [n]
    bound = LOGIT_ATOL + LOGIT_RTOL * unpadded.std(-1)
    report.max_logit_diff = max(report.max_logit_diff, float(diff.max()))
    report.max_logit_excess = max(report.max_logit_excess, float((diff / bound).max()))
    tokens = logits.argmax(-1)
    report.rows += n
    report.greedy_agreed += int((tokens == unpadded.argmax(-1)).sum())
    return tokens.tolist()


def long_prompts(n: int) -> dict[int, list[int]]:
    """n prompts of 130 + 17 r tokens: every context is over 128 tokens (split-KV on a GPU)."""
    return {r: [(11 * r + 7 * j) % 400 + 3 for j in range(130 + 17 * r)] for r in range(n)}


def decode_step(run: PagedRun, tokens: dict[Any, int]) -> SimpleNamespace:
    """Each request's next token, with a slot allocated; the step as the runner builds it."""
    seq_lens, tables = [], []
    for r in tokens:
        table = run.tables[r]
        run.lens[r] += 1
        while len(table) * run.block_size < run.lens[r]:
            table.append(run.free.pop())
        seq_lens.append(run.lens[r])
        tables.append(table)
    md = build_metadata([1] * len(tokens), seq_lens, tables, run.block_size, run.device)
    ids = torch.tensor(list(tokens.values()), dtype=torch.long, device=run.device)
    return SimpleNamespace(input_ids=ids, positions=md.positions, attn_metadata=md)


def check_graph_decode(
    gr: GraphRunner, run: PagedRun, prompts: dict[Any, list[int]], steps: int
) -> GraphEquality:
    """Prefill `prompts` eagerly, then `steps` decode steps through `compare_decode_step`,
    the batch shrinking by one request each step (down to one) so buckets and padding vary.
    `gr` must be captured over `run.kv_caches`."""
    report = GraphEquality()
    last = {r: int(lg[-1].argmax()) for r, lg in run.step(prompts).items()}
    for s in range(steps):
        live = list(prompts)[: max(1, len(prompts) - s)]
        step = decode_step(run, {r: last[r] for r in live})
        for r, tok in zip(live, compare_decode_step(gr, run.model, step, report), strict=True):
            last[r] = tok
    return report
