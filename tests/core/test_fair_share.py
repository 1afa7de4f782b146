"""Fair share by tenant under overload (the `fair` policy, a Virtual Token Counter): two
backlogged tenants of weights 1:3 get service within the VTC bound computed from the
configured weights, and the same test under `fcfs` fails it; a tenant back from idle is
not owed its idle time (and would be without the counter's lift); no idle capacity while
anyone waits (work conservation); priority order within a tenant; `max_running`.

Service is measured from the scheduler's own output, step by step: every scheduled
position before a request's prompt end is an input token, every one at or past it an
output token, weighted by the configured charges and divided by the tenant's weight.
No clock is involved: a step is a step.
"""

from __future__ import annotations

import itertools
from collections.abc import Container

import pytest

from engine.core.policy.fair_share import VirtualTokenCounter
from engine.core.policy.tenant import Tenant
from engine.core.scheduler import Scheduler
from engine.core.step_io import SchedulerOutput
from tests.support.scheduler_helpers import make_request, make_scheduler, step

PROMPT, OUTPUT = 16, 8
W_IN, W_OUT = 1.0, 2.0


def _service(sched: Scheduler, so: SchedulerOutput, tenants: dict[str, Tenant]) -> dict[str, float]:
    """Weighted tokens each tenant got in this step, divided by its weight."""
    starts = {d.request_id: d.num_computed_tokens for d in so.scheduled_new_reqs}
    starts |= {d.request_id: d.num_computed_tokens for d in so.scheduled_cached_reqs}
    got = dict.fromkeys(tenants, 0.0)
    for rid, n in so.num_scheduled_tokens.items():
        req = sched.get_request(rid)
        if req is None:  # finished in this very step's update: read it from our own record
            req = _seen[rid]
        start, p = starts[rid], req.num_prompt_tokens
        inp = max(0, min(start + n, p) - start)
        name = req.tenant.name
        got[name] += (inp * W_IN + (n - inp) * W_OUT) / tenants[name].weight
    return got


_seen: dict = {}
_ids = itertools.count()


def _top_up(sched: Scheduler, tenants: dict[str, Tenant], keep: int, step_no: int) -> None:
    """Keeps `keep` requests of every tenant waiting (each tenant stays backlogged)."""
    for name, tenant in tenants.items():
        while sched.waiting.num_queued(name) < keep:
            rid = f"{name}-{next(_ids)}"
            req = make_request(
                rid, PROMPT, max_tokens=OUTPUT, arrival=float(step_no), tenant=tenant,
                ignore_eos=True,
            )  # fmt: skip
            _seen[rid] = req
            sched.add_request(req)


def vtc_bound(tenants: dict[str, Tenant], max_num_seqs: int) -> float:
    """The gap the fair policy allows between two backlogged tenants' weighted service
    (normalised by weight), from the configured weights.

    One admitted request can add at most its whole cost, U = w_in * prompt + w_out *
    output, before it ends, and a tenant holds at most max_num_seqs requests. A tenant is
    admitted only while its counter, less its slack, is the lowest; the slack of a tenant
    within its seat share is its share of the seats times U over its weight
    (`tenant_slots.share_slack`), i.e. at most max_num_seqs * U / (sum of weights). So each
    backlogged tenant's counter stays within max_num_seqs * U / weight plus that slack of
    the lowest one, and any two differ in what they gained over an interval by at most
    twice that for the lightest tenant.
    """
    u = W_IN * PROMPT + W_OUT * OUTPUT
    weights = [t.weight for t in tenants.values()]
    return 2 * (max_num_seqs * u / min(weights) + max_num_seqs * u / sum(weights))


def run_backlogged(policy: str, steps: int = 400) -> tuple[float, list[float]]:
    """Two tenants of weights 1:3, both kept backlogged for `steps` steps; returns the bound
    and, after every step, the gap between their normalised service so far."""
    tenants = {"a": Tenant("a", weight=1), "b": Tenant("b", weight=3)}
    sched = make_scheduler(
        num_blocks=512, max_num_seqs=8, max_num_batched_tokens=32, policy=policy,
        max_queue_len=64, charge_input_token=W_IN, charge_output_token=W_OUT,
    )  # fmt: skip
    total = dict.fromkeys(tenants, 0.0)
    gaps = []
    for i in range(steps):
        _top_up(sched, tenants, keep=2, step_no=i)
        so, _ = step(sched)
        for name, v in _service(sched, so, tenants).items():
            total[name] += v
        gaps.append(abs(total["a"] - total["b"]))
    return vtc_bound(tenants, 8), gaps


def check_vtc_bound(policy: str) -> None:
    """The fairness claim: the weighted service gap never passes the VTC bound."""
    bound, gaps = run_backlogged(policy)
    assert max(gaps) <= bound, f"gap {max(gaps):.0f} > bound {bound:.0f} under {policy}"


def test_backlogged_tenants_weighted_1_to_3_stay_within_the_vtc_bound():
    check_vtc_bound("fair")


def test_the_same_run_under_fcfs_breaks_the_bound():
    """The test discriminates: FCFS serves both tenants alike (their requests arrive
    alike), so the weighted gap grows with the run and passes the bound."""
    with pytest.raises(AssertionError, match="under fcfs"):
        check_vtc_bound("fcfs")


def test_fcfs_gap_grows_far_past_the_bound():
    bound, gaps = run_backlogged("fcfs")
    assert gaps[-1] > 3 * bound  # a third of B's share goes to A, step after step


def _return_from_idle(lift: bool) -> tuple[float, float, float]:
    """A alone for 200 steps, then B (same weight) returns; both backlogged 200 steps more.
    Returns (A's service, B's service) over the second half and the bound."""
    tenants = {"a": Tenant("a"), "b": Tenant("b")}
    sched = make_scheduler(
        num_blocks=512, max_num_seqs=8, max_num_batched_tokens=32, policy="fair",
        charge_input_token=W_IN, charge_output_token=W_OUT,
    )  # fmt: skip
    if not lift:
        sched.policy.counter.lift = lambda name, backlogged: None  # type: ignore[method-assign]
    for i in range(200):
        _top_up(sched, {"a": tenants["a"]}, keep=2, step_no=i)
        step(sched)
    half = dict.fromkeys(tenants, 0.0)
    for i in range(200, 400):
        _top_up(sched, tenants, keep=2, step_no=i)
        so, _ = step(sched)
        for name, v in _service(sched, so, tenants).items():
            half[name] += v
    return half["a"], half["b"], vtc_bound(tenants, 8)


def test_a_tenant_back_from_idle_is_not_owed_its_idle_time():
    a, b, bound = _return_from_idle(lift=True)
    assert abs(a - b) <= bound, (a, b, bound)
    assert a > 0.4 * (a + b)  # A keeps about half from B's first step on


def test_without_the_lift_the_returning_tenant_would_starve_the_other():
    """The idle test discriminates: with the counter's lift disabled, B (counter 0) takes
    everything until it catches up with A's 200 steps of service."""
    a, b, bound = _return_from_idle(lift=False)
    assert b - a > bound
    assert a < 0.1 * (a + b)


def test_fair_policy_is_work_conserving():
    """A lone tenant gets every token of every step, however light its weight; a tenant
    held back by its own max_running leaves the seats it cannot use to the other."""
    light, heavy = Tenant("light", weight=1), Tenant("heavy", weight=100, max_running=1)
    sched = make_scheduler(num_blocks=512, max_num_seqs=4, max_num_batched_tokens=32, policy="fair")
    for i in range(60):
        _top_up(sched, {"light": light}, keep=3, step_no=i)
        if i >= 30:
            _top_up(sched, {"heavy": heavy}, keep=3, step_no=i)
        so, _ = step(sched)
        # No idle capacity while someone who may run waits: the budget or the seats are full.
        assert so.total_num_scheduled_tokens == 32 or len(so.num_scheduled_tokens) == 4, i
        running = [sched.get_request(r) or _seen[r] for r in so.num_scheduled_tokens]
        assert sum(r.tenant is heavy for r in running) <= 1


def test_priority_orders_requests_within_a_tenant_and_counters_across_tenants():
    a, b = Tenant("a"), Tenant("b")
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, policy="fair")
    reqs = [
        make_request("a-low", 8, 1, priority=5, arrival=0.0, tenant=a),
        make_request("a-mid", 8, 1, priority=3, arrival=1.0, tenant=a),
        make_request("a-high", 8, 1, priority=0, arrival=2.0, tenant=a),
        make_request("b-1", 8, 1, arrival=3.0, tenant=b),
        make_request("b-2", 8, 1, arrival=4.0, tenant=b),
    ]
    for r in reqs:
        sched.add_request(r)
    order = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        order += [d.request_id for d in so.scheduled_new_reqs]
    # One seat: each request runs alone (8 prompt tokens, 1 output) and costs the same, so
    # the tenants alternate; within a tenant, priority order (arrival breaks ties).
    assert order == ["a-high", "b-1", "a-mid", "b-2", "a-low"]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair", "deadline"])
def test_max_running_caps_a_tenant_and_its_queue_waits_in_order(policy):
    capped, free = Tenant("capped", max_running=2), Tenant("free")
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=256, policy=policy)
    for i in range(4):
        sched.add_request(make_request(f"c{i}", 8, 2, arrival=float(i), tenant=capped))
    sched.add_request(make_request("f0", 8, 2, arrival=10.0, tenant=free))
    so, _ = step(sched)
    assert {d.request_id for d in so.scheduled_new_reqs} == {"c0", "c1", "f0"}
    assert [r.request_id for r in sched.waiting] == ["c2", "c3"]
    step(sched)  # c0, c1, f0 finish (2 tokens each)
    so, _ = step(sched)
    assert [d.request_id for d in so.scheduled_new_reqs] == ["c2", "c3"]


@pytest.mark.parametrize("policy, victim", [("fair", "a1"), ("fcfs", "b0")])
def test_fair_victim_is_the_most_served_tenants_last_request(policy, victim):
    """Memory pressure: under fair the tenant with the higher counter loses a request, even
    when another tenant's request is the newest running (which FCFS takes)."""
    a, b = Tenant("a"), Tenant("b")
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64, policy=policy)
    sched.add_request(make_request("a0", 8, 16, arrival=0.0, tenant=a, ignore_eos=True))
    sched.add_request(make_request("a1", 8, 16, arrival=1.0, tenant=a, ignore_eos=True))
    step(sched)  # a0, a1: 2 blocks each
    sched.add_request(make_request("b0", 8, 16, arrival=2.0, tenant=b, ignore_eos=True))
    preempted: set[str] = set()
    for _ in range(12):  # decode until the 8 blocks run out
        so, _ = step(sched)
        if so.preempted_req_ids:
            preempted = so.preempted_req_ids
            break
    assert preempted == {victim}


def _seats_full_of_a(
    preempt: bool,
    deadlines: Container[str] = (),
    out_len: dict[str, int] | None = None,
    wait_steps: int = 1,
) -> Scheduler:
    a, b = Tenant("a"), Tenant("b")
    sched = make_scheduler(
        num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, policy="fair",
        preempt_for_fairness=preempt, preempt_for_fairness_wait_steps=wait_steps,
    )  # fmt: skip
    for i in range(6):
        rid = f"a{i}"
        sched.add_request(
            make_request(
                rid, 8, (out_len or {}).get(rid, 40), arrival=float(i), tenant=a,
                ignore_eos=True, deadline=1e9 if rid in deadlines else None,
            )
        )  # fmt: skip
    step(sched)
    step(sched)
    sched.add_request(make_request("b0", 8, 4, arrival=10.0, tenant=b, ignore_eos=True))
    return sched


def test_seats_held_by_one_tenant_make_another_wait_without_preempt_for_fairness():
    sched = _seats_full_of_a(preempt=False)
    so, _ = step(sched)
    assert "b0" not in so.num_scheduled_tokens and not so.preempted_req_ids


def test_preempt_for_fairness_swaps_an_over_share_request_for_the_waiting_tenant():
    sched = _seats_full_of_a(preempt=True, wait_steps=0)
    so, _ = step(sched)
    assert so.preempted_req_ids == {"a3"}  # a's last admitted (largest arrival)
    assert [d.request_id for d in so.scheduled_new_reqs] == ["b0"]
    assert sched.get_request("a3").status.name == "PREEMPTED"
    # b holds 1 of 4 seats, under its share of 2: nothing more to swap while a is ahead.
    so, _ = step(sched)
    assert not so.preempted_req_ids


def test_the_waiting_request_swaps_only_after_its_wait_steps():
    """With wait 1, b0 gets one step for a seat to free by itself (none does: every a has
    38 tokens left) and is swapped in at its second; with 2 at its third; with 0 at once."""
    for wait, swap_step in ((0, 1), (1, 2), (2, 3)):
        sched = _seats_full_of_a(preempt=True, wait_steps=wait)
        for k in range(1, 4):
            so, _ = step(sched)
            assert bool(so.preempted_req_ids) == (k == swap_step), (wait, k)
            assert ("b0" in so.num_scheduled_tokens) == (k >= swap_step), (wait, k)


def test_a_seat_that_frees_in_the_wait_costs_no_swap():
    """a1 ends with the first step after b0 arrives: b0 takes its seat in the second, and
    nothing is preempted."""
    sched = _seats_full_of_a(preempt=True, out_len={"a1": 3}, wait_steps=1)
    so, _ = step(sched)
    assert not so.preempted_req_ids and "b0" not in so.num_scheduled_tokens
    assert sched.get_request("a1") is None  # finished and gone
    so, _ = step(sched)
    assert "b0" in so.num_scheduled_tokens and not so.preempted_req_ids


def test_preempt_for_fairness_never_takes_a_request_with_a_deadline():
    """Recompute could make it miss its deadline: the next request without one goes, and
    with deadlines on every running request of the over-share tenant nothing is swapped."""
    sched = _seats_full_of_a(preempt=True, deadlines={"a3"}, wait_steps=0)
    so, _ = step(sched)
    assert so.preempted_req_ids == {"a2"}
    sched = _seats_full_of_a(preempt=True, deadlines={"a0", "a1", "a2", "a3"}, wait_steps=0)
    so, _ = step(sched)
    assert not so.preempted_req_ids and "b0" not in so.num_scheduled_tokens


def test_counter_lift_uses_the_lowest_backlogged_counter():
    from engine.core.policy.charges import ChargeRules

    vtc = VirtualTokenCounter(ChargeRules())
    vtc._counters.update({"a": 100.0, "b": 40.0})
    vtc.lift("c", ["a", "b"])
    assert vtc.value("c") == 40.0
    vtc.left("a")
    vtc.lift("d", [])  # nobody backlogged: the last to leave
    assert vtc.value("d") == 100.0
    vtc._counters["e"] = 500.0
    vtc.lift("e", ["a", "b"])  # never lowered
    assert vtc.value("e") == 500.0


def _light_tenant_ahead_on_the_counter(b_running: int) -> Scheduler:
    """Five seats, two tenants of equal weight (a share of 2.5 seats each): tenant a holds
    two seats and floods the queue, tenant b holds `b_running` and has one more request
    waiting, and b's counter is 1.5 requests' cost ahead of a's (what its own recent
    requests were charged)."""
    a, b = Tenant("a"), Tenant("b")
    sched = make_scheduler(
        num_blocks=64, max_num_seqs=5, max_num_batched_tokens=64, policy="fair",
        charge_input_token=W_IN, charge_output_token=W_OUT,
    )  # fmt: skip
    for i in range(2):
        sched.add_request(make_request(f"r{i}", 8, 40, arrival=float(i), tenant=a, ignore_eos=True))
    for i in range(b_running):
        sched.add_request(make_request(f"b{i}", 8, 40, arrival=float(i), tenant=b, ignore_eos=True))
    step(sched)
    for i in range(6):
        sched.add_request(make_request(f"a{i}", 8, 8, arrival=10.0 + i, tenant=a, ignore_eos=True))
    sched.add_request(make_request("bx", 8, 8, arrival=20.0, tenant=b, ignore_eos=True))
    counters = sched.policy.counter._counters
    counters["a"] = 100.0
    counters["b"] = 100.0 + 1.5 * (8 * W_IN + 8 * W_OUT)
    return sched


def test_a_tenant_within_its_share_is_not_held_behind_a_flood_by_its_own_last_charge():
    """b holds one seat of its 2.5, a two (at its share): b's request goes ahead of a's
    queue although b's counter is ahead (under the plain lowest-counter rule a's requests
    would take both free seats: each admission lifts a's counter by one prompt, never past
    b's)."""
    sched = _light_tenant_ahead_on_the_counter(b_running=1)
    so, _ = step(sched)
    assert [d.request_id for d in so.scheduled_new_reqs] == ["bx", "a0"]


def test_a_tenant_at_its_share_gets_no_slack():
    """b holds two seats too: neither may take a third within its share, so the lower
    counter, a's, takes the free seat."""
    sched = _light_tenant_ahead_on_the_counter(b_running=2)
    so, _ = step(sched)
    assert [d.request_id for d in so.scheduled_new_reqs] == ["a0"]
