"""Per-request deadlines in the scheduler, on a fake clock: a request whose deadline passes
while it waits is dropped before any compute (it never appears in a SchedulerOutput); one
that passes while it runs is stopped at the next step, its blocks freed and the runner told;
an expired arrival is refused; `deadline` orders a tenant's queue earliest deadline first;
the deadline heap forgets finished requests."""

from __future__ import annotations

import pytest

from engine.core.policy.tenant import Tenant
from engine.core.request import RequestStatus
from engine.errors import DeadlineExceededError
from tests.support.scheduler_helpers import FakeClock, make_request, make_scheduler, step


def _scheduled_ever(outputs) -> set[str]:
    return {rid for so in outputs for rid in so.num_scheduled_tokens}


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair", "deadline"])
def test_a_request_whose_deadline_passes_in_the_queue_never_gets_a_step(policy):
    clock = FakeClock()
    sched = make_scheduler(clock=clock, policy=policy, max_num_seqs=1)
    sched.add_request(make_request("busy", 8, 4, arrival=clock.now, ignore_eos=True))
    outputs = [step(sched)[0]]  # one seat: busy holds it, late waits
    sched.add_request(make_request("late", 8, 4, arrival=clock.now, deadline=clock.now + 5))
    outputs.append(step(sched)[0])
    clock.advance(5.0)  # the deadline is reached (not after it: deadline <= now expires)
    outputs += [step(sched)[0] for _ in range(6)]
    assert "late" not in _scheduled_ever(outputs)
    ((req, err),) = sched.take_dropped()
    assert req.request_id == "late" and req.status is RequestStatus.FINISHED_ERROR
    assert req.num_computed_tokens == 0 and req.times.first_scheduled is None
    assert req.times.expired == clock.now
    assert isinstance(err, DeadlineExceededError) and "nothing was computed" in str(err)
    assert sched.get_request("late") is None
    # Never in the runner's batch: nothing for it to drop.
    assert all("late" not in so.finished_req_ids for so in outputs)


def test_a_running_request_whose_deadline_passes_is_stopped_at_the_next_step():
    clock = FakeClock()
    sched = make_scheduler(num_blocks=16, clock=clock)
    free0 = sched.kv_manager.num_free_blocks
    sched.add_request(make_request("r", 8, 50, deadline=clock.now + 1, ignore_eos=True))
    sched.add_request(make_request("other", 8, 50, ignore_eos=True))
    step(sched)
    step(sched)
    r = sched.get_request("r")
    assert r.status is RequestStatus.RUNNING and r.num_output_tokens == 2
    clock.advance(1.5)
    so, _ = step(sched)
    assert "r" not in so.num_scheduled_tokens  # no compute in the step after the deadline
    assert "r" in so.finished_req_ids  # the runner drops its state in that very step
    ((req, err),) = sched.take_dropped()
    assert req is r and "while it was running" in str(err)
    assert r.output_token_ids == [7, 7]  # what it had is kept for the caller
    other_blocks = len(sched.kv_manager.get_block_ids("other"))
    assert sched.kv_manager.num_free_blocks == free0 - other_blocks  # r's blocks are back
    assert [q.request_id for q in sched.running] == ["other"]


def test_an_arrival_whose_deadline_has_passed_is_refused():
    clock = FakeClock()
    sched = make_scheduler(clock=clock)
    with pytest.raises(DeadlineExceededError, match="before it reached the queue"):
        sched.add_request(make_request("x", deadline=clock.now - 0.1))
    assert sched.num_waiting == 0


def test_a_preempted_request_past_its_deadline_is_dropped_from_the_queue():
    clock = FakeClock()
    sched = make_scheduler(num_blocks=4, clock=clock)
    sched.add_request(make_request("a", 8, 3, arrival=0.0))
    sched.add_request(make_request("b", 8, 8, arrival=1.0, deadline=clock.now + 1))
    step(sched)
    so, _ = step(sched)  # a needs a block: b (newest) is preempted
    assert so.preempted_req_ids == {"b"}
    clock.advance(2.0)
    so, _ = step(sched)
    assert "b" not in so.num_scheduled_tokens
    assert [r.request_id for r, _ in sched.take_dropped()] == ["b"]
    assert sched.num_waiting == 0


def test_deadline_policy_admits_earliest_deadline_first_within_a_tenant():
    clock = FakeClock()
    sched = make_scheduler(clock=clock, policy="deadline", max_num_seqs=1)
    t = clock.now
    for rid, d in (("none", None), ("late", t + 30), ("soon", t + 10), ("mid", t + 20)):
        sched.add_request(make_request(rid, 8, 1, arrival=t, deadline=d))
    order = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        order += [d.request_id for d in so.scheduled_new_reqs]
    assert order == ["soon", "mid", "late", "none"]


def test_deadline_policy_keeps_fair_share_across_tenants():
    clock = FakeClock()
    a, b = Tenant("a"), Tenant("b")
    sched = make_scheduler(clock=clock, policy="deadline", max_num_seqs=1)
    t = clock.now
    sched.add_request(make_request("a-soon", 8, 1, arrival=t, deadline=t + 1, tenant=a))
    sched.add_request(make_request("a-sooner", 8, 1, arrival=t, deadline=t + 0.5, tenant=a))
    sched.add_request(make_request("b-late", 8, 1, arrival=t, deadline=t + 99, tenant=b))
    order = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        order += [d.request_id for d in so.scheduled_new_reqs]
    # Earliest deadline first inside a; a and b alternate by their counters.
    assert order == ["a-sooner", "b-late", "a-soon"]


def test_the_deadline_heap_forgets_finished_requests():
    clock = FakeClock()
    sched = make_scheduler(clock=clock, max_num_seqs=64, max_queue_len=512)
    for i in range(400):  # short requests with long deadlines
        sched.add_request(make_request(f"r{i}", 4, 1, deadline=clock.now + 3600))
        step(sched)
        assert not sched.has_unfinished_requests()
    sched.add_request(make_request("last", 4, 1, deadline=clock.now + 3600))
    clock.advance(1.0)
    step(sched)
    # Rebuilt whenever it passes twice the live requests (+ slack): bounded, not 401.
    assert len(sched.policy.deadlines) <= 2 * 1 + 64 + 1
