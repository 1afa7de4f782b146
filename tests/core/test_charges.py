"""What a tenant's virtual token counter is charged (`engine.core.policy.charges`, the one
rule, and the counter's hooks that other features call): input and output token weights;
prefix-cache and KV-tier hits, recompute after preemption, rejected speculative tokens and
embedding requests each counted only as their `scheduler.charge_*` key says; the weight
divides every charge."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, SchedulerConfig
from engine.core.policy.charges import ChargeRules
from engine.core.policy.fair_share import VirtualTokenCounter
from engine.core.policy.tenant import Tenant
from tests.support.scheduler_helpers import make_request, make_scheduler, step


def test_defaults_are_the_documented_ones():
    r = ChargeRules.of(SchedulerConfig())
    assert r == ChargeRules(
        input_token=1.0, output_token=2.0, prefix_cache_hits=False, tier_cache_hits=False,
        rejected_speculative=False, recompute=False, embeddings=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "rules, kw, cost",
    [
        (ChargeRules(), {"input_tokens": 10, "output_tokens": 3}, 10 * 1 + 3 * 2),
        (
            ChargeRules(input_token=0.5, output_token=4),
            {"input_tokens": 10, "output_tokens": 3},
            17,
        ),
        (ChargeRules(), {"prefix_hit_tokens": 32}, 0),
        (ChargeRules(prefix_cache_hits=True), {"prefix_hit_tokens": 32}, 32),
        (ChargeRules(), {"tier_hit_tokens": 32}, 0),
        (ChargeRules(tier_cache_hits=True), {"tier_hit_tokens": 32}, 32),
        (ChargeRules(), {"recomputed_input": 8, "recomputed_output": 2}, 0),
        (ChargeRules(recompute=True), {"recomputed_input": 8, "recomputed_output": 2}, 12),
        (ChargeRules(), {"rejected_tokens": 3}, -6),  # a refund of what was charged
        (ChargeRules(rejected_speculative=True), {"rejected_tokens": 3}, 0),
        (ChargeRules(), {"input_tokens": 10, "embedding": True}, 10),
        (ChargeRules(embeddings=False), {"input_tokens": 10, "embedding": True}, 0),
    ],
)
def test_the_one_charging_rule(rules, kw, cost):
    assert rules.cost(**kw) == cost


def test_charge_weights_are_checked():
    with pytest.raises(ConfigError, match="scheduler.charge_input_token"):
        SchedulerConfig(charge_input_token=-1)
    with pytest.raises(ConfigError, match="must not both be 0"):
        SchedulerConfig(charge_input_token=0, charge_output_token=0)
    with pytest.raises(ConfigError, match="scheduler.policy"):
        SchedulerConfig(policy="lottery")


def _counter(**rules) -> VirtualTokenCounter:
    return VirtualTokenCounter(ChargeRules(**rules))


def test_scheduled_positions_split_into_input_and_output_and_weight_divides():
    vtc = _counter()
    req = make_request("r", 10, 8, tenant=Tenant("t", weight=2))
    vtc.charge_scheduled(req, 0, 6)  # a prompt chunk: 6 input
    vtc.charge_scheduled(req, 6, 4)  # the rest of the prompt
    vtc.charge_scheduled(req, 10, 1)  # a decode: position 10 is the first output fed back
    assert vtc.value("t") == (10 * 1 + 1 * 2) / 2
    assert req.num_charged_tokens == 11


def test_recompute_after_preemption_is_free_unless_charge_recompute():
    for recompute, extra in ((False, 0), (True, 12 + 2 * 2)):
        vtc = _counter(recompute=recompute)
        req = make_request("r", 12, 8)
        vtc.charge_scheduled(req, 0, 12)
        vtc.charge_scheduled(req, 12, 1)
        vtc.charge_scheduled(req, 13, 1)
        before = vtc.value("default")
        vtc.charge_scheduled(req, 0, 14)  # preempted, then recomputed in one chunk
        vtc.charge_scheduled(req, 14, 1)  # a new decode: fresh again
        assert vtc.value("default") - before == extra + 2


def test_prefix_hits_and_tier_hits_follow_their_keys():
    for rules, charged in (({}, 0), ({"prefix_cache_hits": True}, 16)):
        vtc = _counter(**rules)
        req = make_request("r", 20, 4)
        vtc.charge_cache_hits(req, 16)  # admission found 16 prompt tokens cached
        vtc.charge_scheduled(req, 16, 4)
        assert vtc.value("default") == charged + 4
    vtc = _counter(tier_cache_hits=True)
    req = make_request("r", 20, 4)
    vtc.charge_cache_hits(req, 8)  # prefix cache: free
    vtc.charge_cache_hits(req, 16, tier=True)  # 8 more loaded from a tier: charged
    assert vtc.value("default") == 8 and req.num_charged_tokens == 16


def test_rejected_speculative_tokens_are_refunded_and_fresh_again():
    vtc = _counter()
    req = make_request("r", 4, 16)
    vtc.charge_scheduled(req, 0, 4)
    vtc.charge_scheduled(req, 4, 4)  # 1 + 3 speculative positions
    vtc.charge_rejected(req, 2)  # the verifier kept 2 of the 4
    assert vtc.value("default") == 4 + 2 * 2 and req.num_charged_tokens == 6
    vtc.charge_scheduled(req, 6, 1)  # scheduled again: charged as fresh output
    assert vtc.value("default") == 4 + 3 * 2
    kept = _counter(rejected_speculative=True)
    req = make_request("r", 4, 16)
    kept.charge_scheduled(req, 4, 4)
    kept.charge_rejected(req, 2)
    assert kept.value("default") == 8


def test_embedding_requests_follow_charge_embeddings():
    for embeddings, charged in ((True, 12), (False, 0)):
        vtc = _counter(embeddings=embeddings)
        req = make_request("e", 12, 1)
        vtc.charge_scheduled(req, 0, 12, embedding=True)
        assert vtc.value("default") == charged


def test_the_scheduler_charges_what_it_schedules():
    """End to end through schedule(): a prefix hit is free by default, prompts and decodes
    are charged as scheduled."""
    sched = make_scheduler(policy="fair", num_blocks=64)
    shared = list(range(100, 116))
    sched.add_request(make_request("a", shared, 2))
    step(sched)
    step(sched)  # a: 16 prompt + 1 decode = 16 + 2
    assert sched.policy.counter.value("default") == 18
    sched.add_request(make_request("b", shared + [1, 2, 3, 4], 1))
    step(sched)  # b: 16 cached (free), 4 computed
    assert sched.policy.counter.value("default") == 22
    charged = make_scheduler(policy="fair", num_blocks=64, charge_prefix_cache_hits=True)
    charged.add_request(make_request("a", shared, 2))
    step(charged)
    step(charged)
    charged.add_request(make_request("b", shared + [1, 2, 3, 4], 1))
    step(charged)
    assert charged.policy.counter.value("default") == 22 + 16


@pytest.mark.parametrize("recompute", [False, True])
def test_the_running_batchs_fast_path_charges_what_charge_scheduled_does(recompute):
    """`charge_running` inlines the decode case for the hot path: for decodes, prompt chunks
    and recompute alike it must leave every counter and charge mark where `charge_scheduled`
    leaves them (a fast path that drifted from the one rule would fail here)."""
    tenants = (Tenant("a", weight=1), Tenant("b", weight=3))

    def batch() -> list:
        reqs = []
        for i, (computed, charged) in enumerate(
            [(10, 10), (14, 14), (0, 0), (6, 6), (4, 12), (12, 15)]
        ):  # decodes, a first chunk, a later chunk, recompute inside and past the prompt
            r = make_request(f"r{i}", 10, 16, tenant=tenants[i % 2])
            r.num_computed_tokens, r.num_charged_tokens = computed, charged
            reqs.append(r)
        return reqs

    n = {f"r{i}": k for i, k in enumerate([1, 1, 6, 4, 3, 2])}
    fast, slow = _counter(recompute=recompute), _counter(recompute=recompute)
    fast_reqs, slow_reqs = batch(), batch()
    fast.charge_running(fast_reqs, n)
    for r in slow_reqs:
        slow.charge_scheduled(r, r.num_computed_tokens, n[r.request_id])
    assert fast.snapshot() == pytest.approx(slow.snapshot())
    assert [r.num_charged_tokens for r in fast_reqs] == [r.num_charged_tokens for r in slow_reqs]
    assert fast.value("a") > 0 and fast.value("b") > 0
