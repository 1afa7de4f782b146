"""The arithmetic of the speculation benchmarks: the step-cost fit (bench/spec_cost.py) and the
per-run speculation counters (bench/spec_copy.py), which the recorded numbers rest on."""

from __future__ import annotations

import pytest

from bench.spec_copy import METHODS, _spec_delta, copy_messages, speculative_config
from bench.spec_cost import fit_line
from engine.config import speculative_config_from_dict
from engine.core.spec.stats import SpecDecodeStats


def test_fit_line_recovers_the_fixed_cost():
    xs = [1.0, 2.0, 5.0, 17.0]
    a, b = fit_line(xs, [3.0 * (32 + x) for x in xs])  # t = c (F + N), c 3, F 32
    assert a / b == pytest.approx(32.0) and b == pytest.approx(3.0)


def test_spec_delta_counts_only_the_runs_between_the_snapshots():
    stats = SpecDecodeStats()
    stats.record(4, 4)
    before = stats.snapshot()
    stats.record(4, 1)
    stats.record(6, 3)
    d = _spec_delta(before, stats)
    assert (d["drafts"], d["draft_tokens"], d["accepted_tokens"]) == (2, 10, 4)
    assert d["mean_acceptance_length"] == 3.0 and d["acceptance_rate"] == 0.4
    assert d["accepted_per_pos"] == [1.0, 0.5, 0.5, 0.0, 0.0, 0.0]
    assert _spec_delta(None, None) == {}


def test_the_copy_task_quotes_textwrap_and_every_method_is_a_valid_config():
    (msg,) = copy_messages(300)
    assert msg["role"] == "user" and '"""Text wrapping and filling.' in msg["content"]
    for name in METHODS:  # the draft's path filled in (the default model's GGUF)
        speculative_config_from_dict(speculative_config(name))  # ConfigError on a bad entry


def test_spec_served_summary_takes_medians_and_keeps_every_round():
    from bench.spec_served import summarize

    def row(tok_s, tpot, other):
        return {"requests": 8, "failed": 0, "output_tok_per_s": tok_s, "mean_tpot_ms": tpot,
                "mean_tpot_ms_by_kind": {"open": tpot, "copy": None}, "other_cores": other}  # fmt: skip

    rounds = [row(100.0, 50.0, 0.1), row(300.0, 40.0, 0.3), row(200.0, 70.0, 0.2)]
    s = summarize(rounds)
    assert (s["output_tok_per_s"], s["mean_tpot_ms"]) == (200.0, 50.0)
    assert s["mean_tpot_ms_by_kind"] == {"open": 50.0, "copy": None}
    assert s["other_cores"] == 0.3 and s["rounds"] == rounds
    assert "rounds" not in summarize(rounds[:1])
