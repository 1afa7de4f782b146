"""The id-only proposers (n-gram prompt lookup, suffix decoding), their index, and the
adaptive k rule: exact proposals for hand-made token sequences."""

from __future__ import annotations

import pytest

from engine.config import SpeculativeConfig
from engine.core.request import Request, RequestStatus
from engine.core.spec import adaptive
from engine.core.spec.ngram import NgramProposer
from engine.core.spec.proposer import continuation
from engine.core.spec.state import SpecState
from engine.core.spec.suffix import SuffixCache, SuffixProposer
from engine.core.spec.token_index import TokenIndex
from engine.sampling_params import SamplingParams


def _req(tokens: list[int], rid: str = "r", salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def test_token_index_finds_earlier_occurrences_latest_first_never_the_suffix_itself():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    index = TokenIndex(tokens, anchor=2)
    index.index_upto(len(tokens) - 1)
    assert index.candidates(tokens, 8) == [4, 1]  # "1 2" ended at 4 and 1 (not at 7)
    assert [index.match_length(p, tokens, 5) for p in (4, 1)] == [2, 2]
    assert index.candidates(tokens, 1) == [4]


def test_continuation_repeats_a_run_that_reaches_the_end():
    assert continuation([5, 6, 7, 8], 1, 2) == [6, 7]
    # A match 2 tokens before the end: the pair repeats.
    assert continuation([9, 5, 6, 5, 6], 3, 5) == [5, 6, 5, 6, 5]


def test_ngram_proposes_what_followed_the_longest_match():
    # "3 4" follows "1 2" at 0 but "9 1 2" matches longer at 4: its continuation wins.
    tokens = [1, 2, 3, 4, 9, 1, 2, 7, 7, 0, 9, 1, 2]
    st = SpecState()
    got = NgramProposer(2, 3).propose(_req(tokens), st, 3)
    assert got == [7, 7, 0]
    # Too short a match proposes nothing.
    assert NgramProposer(3, 4).propose(_req([1, 2, 5, 1, 2]), SpecState(), 3) == []


def test_ngram_index_grows_with_the_request_not_rebuilt():
    req = _req([4, 5, 6, 4])
    st = SpecState()
    p = NgramProposer(1, 2)
    assert p.propose(req, st, 2) == [5, 6]
    index = st.index
    req.append_output_token_ids([5])
    assert p.propose(req, st, 2) == [6, 4] and st.index is index


def _suffix(**kw) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig(method="suffix", **kw))


def test_suffix_proposes_the_most_frequent_continuation():
    # After "1 2": 3 twice, 5 once. The longest match ("8 1 2", once, followed by 5) is
    # worth less than the frequent one; its expected gain decides.
    tokens = [1, 2, 3, 0, 1, 2, 3, 0, 8, 1, 2, 5, 0, 8, 1, 2]
    got = _suffix(suffix_min_token_prob=0.1).propose(_req(tokens), SpecState(), 4)
    assert got == [5, 0, 8, 1]  # the longest match, "0 8 1 2", agrees with one: prob 1
    tokens = [1, 2, 3, 0, 1, 2, 3, 0, 4, 1, 2, 5, 0, 6, 1, 2]
    got = _suffix(suffix_min_token_prob=0.1).propose(_req(tokens), SpecState(), 2)
    assert got == [3, 0]  # matches of 2: "3 0" twice out of three


def test_suffix_stops_where_the_continuation_gets_unlikely():
    tokens = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 5, 0, 9, 1, 2]
    assert _suffix(suffix_min_token_prob=0.5).propose(_req(tokens), SpecState(), 4) == []
    got = _suffix(suffix_min_token_prob=0.3).propose(_req(tokens), SpecState(), 4)
    # The latest of three equally frequent continuations (p = 1/3), and the one token
    # after it (still 1/3), as far as max_spec_factor x the match length allows.
    assert got == [5, 0]


def test_suffix_learns_from_finished_outputs_only_within_their_cache_keys():
    p = _suffix()
    done = _req([9, 9], "old", salt="alice")
    done.append_output_token_ids([1, 2, 3, 4, 5, 6])
    done.status = RequestStatus.FINISHED_STOPPED
    p.on_finished(done)
    assert p.propose(_req([7, 1, 2], "a", salt="alice"), SpecState(), 3) == [3, 4]
    assert p.propose(_req([7, 1, 2], "b", salt="bob"), SpecState(), 3) == []
    assert p.propose(_req([7, 1, 2], "c"), SpecState(), 3) == []
    aborted = _req([9, 9], "x")
    aborted.append_output_token_ids([1, 2, 3])
    aborted.status = RequestStatus.FINISHED_ABORTED
    p.on_finished(aborted)
    assert p.propose(_req([7, 1, 2], "d"), SpecState(), 3) == []


def test_suffix_cache_keeps_the_latest_outputs_and_compacts():
    cache = SuffixCache(max_requests=2)
    cache.add((), [1, 2, 3])
    cache.add((), [1, 2, 4])
    cache.add((), [1, 2, 5])  # evicts [1, 2, 3]
    index = cache.index_for(())
    starts = index.candidates([1, 2], 8)
    assert [index.tokens[p + 1] for p in starts] == [5, 4]
    for i in range(20):
        cache.add((), [7, 8, i])
    assert len(cache) == 2 and len(cache.index_for(()).tokens) <= 3 * 8


@pytest.mark.parametrize(
    ("accept", "expected"),
    [(0.9, [16, 12, 6, 2]), (0.7, [7, 4, 1, 0]), (0.5, [4, 2, 0, 0]), (0.2, [2, 0, 0, 0])],
)
def test_adaptive_k_shrinks_with_the_batch_and_with_rejections(accept, expected):
    """The table in adaptive.py's docstring (fixed cost 32, at most 16 tokens)."""
    got = [adaptive.StepCost(b, 32.0).best_k(accept, 16) for b in (1, 8, 32, 128)]
    assert got == expected


def test_adaptive_k_counts_what_earlier_requests_of_the_step_took():
    step = adaptive.StepCost(32, 32.0)
    first = step.best_k(0.9, 16)
    step.take(0.9, first)
    assert step.best_k(0.9, 16) < first


def test_acceptance_estimate_follows_recent_verifications():
    st = SpecState()
    assert adaptive.acceptance(st) == 0.5
    for _ in range(4):
        adaptive.record(st, 4, 4)
    high = adaptive.acceptance(st)
    for _ in range(4):
        adaptive.record(st, 4, 0)
    assert high > 0.9 and 0.39 < adaptive.acceptance(st) < 0.41
    for _ in range(40):
        adaptive.record(st, 4, 0)
    assert adaptive.acceptance(st) == pytest.approx(2 / 9)
