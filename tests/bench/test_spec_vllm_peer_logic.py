"""The pure logic under bench/spec_copy.py's vLLM comparison: one TPOT definition over both
engines' timestamp spellings, the step-loop fallback, output comparison, vLLM's counters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.peers.spec_timing import (
    first_divergence,
    request_timing,
    spec_counters,
    spec_summary,
    tpot_from_observations,
)
from bench.spec_copy_vllm import summarize


def test_request_timing_reads_ours_and_vllms_spellings_alike():
    ours = SimpleNamespace(arrival_time=10.0, first_token_time=10.5, last_token_time=12.5)
    t = request_timing(ours, 5)
    assert t["tpot_s"] == pytest.approx(0.5) and t["ttft_s"] == pytest.approx(0.5)
    # vLLM: engine-core monotonic stamps, wall-clock arrival (never subtracted), its latency
    vllm = SimpleNamespace(
        arrival_time=1.7e9, first_token_ts=100.0, last_token_ts=103.0, first_token_latency=0.25
    )
    t = request_timing(vllm, 4)
    assert t["tpot_s"] == pytest.approx(1.0) and t["ttft_s"] == 0.25
    assert t["source"] == "request_state_stats"
    # stats not logged: zeros, so the caller must measure by stepping
    assert request_timing(SimpleNamespace(first_token_ts=0.0, last_token_ts=0.0), 4) is None
    assert request_timing(None, 4) is None
    assert request_timing(ours, 1)["tpot_s"] is None


def test_step_observations_give_decode_time_over_tokens_with_bursts_sharing_a_time():
    # first token at 1.0; a burst of 4 accepted at 2.0; the final count first seen at 3.0
    obs = [(0.5, 0), (1.0, 1), (2.0, 5), (3.0, 9), (3.5, 9)]
    t = tpot_from_observations(obs, t_start=0.0)
    assert t["tokens"] == 9 and t["ttft_s"] == 1.0
    assert t["tpot_s"] == pytest.approx(2.0 / 8)
    assert tpot_from_observations([], 0.0)["tpot_s"] is None


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence(None, [1]) is None


def test_vllm_counters_and_their_summary_over_the_timed_repeats():
    before = spec_counters(
        [
            ("vllm:spec_decode_num_drafts", 2),
            ("vllm:spec_decode_num_accepted_tokens_per_pos", [2, 1, 0, 0]),
        ]
    )
    after = spec_counters(
        [
            ("vllm:spec_decode_num_drafts", 6),
            ("vllm:spec_decode_num_draft_tokens", 16),
            ("vllm:spec_decode_num_accepted_tokens", 10),
            ("vllm:other", 99),
            ("vllm:spec_decode_num_accepted_tokens_per_pos", [6, 4, 2, 1]),
        ]
    )
    s = spec_summary(before, after)
    assert (s["drafts"], s["draft_tokens"], s["accepted_tokens"]) == (4, 16, 10)
    assert s["mean_acceptance_length"] == 3.5 and s["acceptance_rate"] == 0.625
    assert s["accepted_per_pos"] == [1.0, 0.75, 0.5, 0.25]


def test_summarize_compares_vllms_output_with_ours_and_with_its_own_run_without():
    ctr = spec_counters([])
    rs = [
        {
            "ids": [1, 2, 3],
            "tokens": 3,
            "tpot_ms": t,
            "tok_s": 9.0,
            "ttft_s": 0.1,
            "other_cores": 0.2,
            "tpot_source": "request_state_stats",
            "spec_before": ctr,
            "spec_after": ctr,
        }
        for t in (30.0, 10.0, 20.0)
    ]
    s = summarize(rs, ours_none_ids=[1, 2, 4], vllm_none_ids=[1, 2, 3])
    assert s["tpot_ms"] == 20.0 and s["runs"] == 3
    assert s["greedy_equal_to_none"] is True and s["equal_to_ours_none"] is False
    assert s["first_divergence_vs_ours_none"] == 2 and s["drafts"] == 0
