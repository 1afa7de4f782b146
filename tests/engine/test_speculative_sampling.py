"""Sampling with speculative decoding: exact for seeded requests with the id-only
proposers, distribution-preserving with a draft model's sampled proposals.

* Seeded requests with every sampling option at once (temperature, top-k/p, min-p,
  repetition/presence/frequency penalties, logit_bias, allowed ids, min_tokens with EOS,
  logprobs) get the same tokens and logprobs with n-gram speculation as without: each
  position's draw comes from (seed, position) and each option is applied as of that
  position.
* A stub worker-side proposer that samples its proposals from a fixed distribution q (so
  the engine applies the rejection rule): 1,000 samples of output positions 2 and 3 (the
  first ones verified) with and without speculation, temperature 1 and top-p 0.9, fixed
  seeds, compared with a chi-square test of homogeneity (8 degrees of freedom) at
  significance 0.001 each (critical value 26.1). The mutation that skips the resampling
  step (emitting from p instead of max(p - q, 0) after a rejection) fails the same test.
  Power against it: in pilot runs of this setup with seeds 1, 2, 3 the mutated statistic at
  position 2 was 82, 95 and 68 (noncentrality about 70: power about 0.999 at 0.001).
"""

from __future__ import annotations

import collections

import pytest
import torch

from engine import SamplingParams
from engine.worker.spec import rejection
from engine.worker.spec.proposer import WorkerProposer
from tests.engine.test_speculative_equality import _checkpoint, _draft_of, _llm

K = 4


def _seeded_params(i: int, **kw) -> SamplingParams:
    options = [
        dict(temperature=0.8, top_p=0.9, logprobs=3),
        dict(temperature=0.6, top_k=20, repetition_penalty=1.3, logprobs=0),
        dict(temperature=0.7, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.4),
        dict(temperature=0.5, logit_bias={7: 3.0, 11: -50.0}, min_tokens=10, ignore_eos=False),
        dict(temperature=0.9, allowed_token_ids=list(range(3, 200))),
    ][i % 5]
    return SamplingParams(seed=100 + i, max_tokens=40, **{"ignore_eos": True, **options, **kw})


def _logprob_triples(c):
    return [[(t, round(lp, 4)) for t, lp in e.top] + [(e.token_id, round(e.logprob, 4))]
            for e in (c.logprobs or [])]  # fmt: skip


def test_seeded_sampling_is_identical_with_and_without_ngram_speculation(tiny_checkpoint):
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    prompts = [{"prompt_token_ids": [5 + i, 9, 13 + i, 5 + i, 9, 13 + i, 5 + i]} for i in range(10)]
    params = [_seeded_params(i) for i in range(10)]

    def run(spec):
        llm = _llm(model_dir, spec)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        lps = [_logprob_triples(o.outputs[0]) for o in outs]
        return got, lps, llm.engine.stats()

    expected, expected_lps, _ = run(None)
    got, lps, stats = run({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1})
    assert got == expected
    assert lps == expected_lps  # one entry per emitted token, the same values
    spec = stats.spec_decode
    assert spec.num_draft_tokens > spec.num_accepted_tokens > 0


class SamplingStub(WorkerProposer):
    """Proposes i.i.d. draws from a fixed q (its own seeded generator) and says so, so the
    engine verifies them with the rejection rule."""

    def __init__(self, q: torch.Tensor):
        self.q = q
        self.gen = torch.Generator().manual_seed(1234)
        self.kept: dict[str, list[int]] = {}

    def propose(self, ctx):
        out = {}
        for rid, k in ctx.lookahead.items():
            if rid in ctx.states and k:
                ids = torch.multinomial(self.q, k, replacement=True, generator=self.gen)
                out[rid] = self.kept[rid] = ids.tolist()
        return out

    def draft_probs(self, request_id, drafts):
        kept = self.kept.get(request_id)
        if kept is None or kept[: len(drafts)] != drafts:
            return None
        return self.q.expand(len(drafts), -1)


N = 1000
POSITIONS = (2, 3)
CELLS = 8  # the reference's most frequent tokens at a position; the rest in one cell


def _position_counts(llm, prompt, seed: int) -> list[collections.Counter]:
    torch.manual_seed(seed)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, params, use_tqdm=False)
    return [collections.Counter(o.outputs[0].token_ids[p] for o in outs) for p in POSITIONS]


def _homogeneity_p_value(a: collections.Counter, b: collections.Counter) -> tuple[float, float]:
    """(p-value, statistic) of Pearson's chi-square test that two samples share a
    distribution, over the CELLS most frequent tokens of `a` and one cell for the rest."""
    top = [tok for tok, _ in a.most_common(CELLS)]
    cells = [(a[t], b[t]) for t in top]
    cells.append(
        (sum(a.values()) - sum(x for x, _ in cells), sum(b.values()) - sum(y for _, y in cells))
    )
    obs = torch.tensor(cells, dtype=torch.float64)
    exp = obs.sum(1, keepdim=True) * obs.sum(0, keepdim=True) / obs.sum()
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(len(cells) - 1))
    return float(torch.special.gammaincc(dof / 2, stat / 2)), float(stat)


@pytest.fixture(scope="module")
def sampling_setup(tiny_checkpoint):
    # weight_std 0.6: peaked distributions, so the first tokens vary little and positions 2
    # and 3 have a few likely tokens for q to propose.
    model_dir = tiny_checkpoint("llama", weight_std=0.6)
    prompt = [17, 33, 17, 33, 5]
    kw = dict(max_num_seqs=256, num_kv_blocks=2048)
    reference = _position_counts(_llm(model_dir, **kw), prompt, seed=0)
    # q: uniform over the reference's 4 most frequent tokens at position 2: often right
    # (accepted) and often not (rejected), and far enough from p that skipping the
    # resampling step over-weights those tokens by a margin the test must see.
    q = torch.zeros(512)
    q[[tok for tok, _ in reference[0].most_common(4)]] = 0.25
    spec = {"model": str(_draft_of(model_dir)), "num_speculative_tokens": 2, "adaptive": False}
    llm = _llm(model_dir, spec, **kw)
    llm.engine.runner.proposer = SamplingStub(q)
    return llm, prompt, reference


def test_sampled_proposals_keep_the_target_distribution(sampling_setup):
    llm, prompt, reference = sampling_setup
    got = _position_counts(llm, prompt, seed=1)
    spec = llm.engine.stats().spec_decode
    assert spec.num_draft_tokens > spec.num_accepted_tokens > 0
    for ref, ours in zip(reference, got, strict=True):
        p_value, _ = _homogeneity_p_value(ref, ours)
        assert p_value > 0.001


def test_skipping_the_resampling_step_changes_the_distribution(sampling_setup, monkeypatch):
    llm, prompt, reference = sampling_setup
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    got = _position_counts(llm, prompt, seed=1)
    results = [_homogeneity_p_value(r, o) for r, o in zip(reference, got, strict=True)]
    assert min(p for p, _ in results) < 1e-6, results
