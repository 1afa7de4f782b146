"""Scheduler preemption when the KV pool runs out: FCFS evicts the newest running request
(possibly the one asking), priority evicts the lowest-priority latest arrival (unscheduling
a victim already scheduled this step and returning its budget), preempted requests resume
with the same tokens, no admission happens in a step that preempted, and the waiting queue
keeps FCFS / priority-then-arrival order. Helpers live in `tests/support/scheduler_helpers.py`.
"""

from __future__ import annotations

from dataclasses import replace

from engine.core.request import Request, RequestStatus
from tests.support.scheduler_helpers import (
    SAMPLED,
    make_request,
    make_scheduler,
    step,
    two_full_requests,
)

# ---- preemption ---------------------------------------------------------------------------


def test_fcfs_preempts_the_newest_running_request():
    sched, a, b = two_full_requests()
    so, _ = step(sched)  # a needs a third block: b (newest) is preempted
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.preempted_req_ids == {"b"} and so.finished_req_ids == {"b"}
    assert so.scheduled_cached_reqs[0].new_block_ids == [3]  # b's blocks freed tail first
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and len(b.times.preempted) == 1
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and sched.running == [a]


def test_preempted_request_resumes_with_same_tokens():
    sched, a, b = two_full_requests()
    step(sched)  # b preempted
    so, _ = step(sched)  # a decodes its 3rd token and finishes; b can't fit yet
    assert so.num_scheduled_tokens == {"a": 1}
    assert a.status is RequestStatus.FINISHED_LENGTH
    so, updated = step(sched)
    assert so.finished_req_ids == {"a"}
    (nb,) = so.scheduled_new_reqs
    assert nb.request_id == "b"
    assert nb.prompt_token_ids + nb.output_token_ids == b.prompt_token_ids + [SAMPLED]
    # b's first block is still cached (its second was evicted by a): 4 tokens recomputed
    # from position 4, the prompt's rest and the output token.
    assert nb.num_computed_tokens == 4 and so.num_scheduled_tokens == {"b": 5}
    assert nb.block_ids[0] == 2
    assert b.num_cached_tokens == 0  # counted at first scheduling only
    assert updated == [b] and b.output_token_ids == [SAMPLED, SAMPLED]
    assert b.status is RequestStatus.RUNNING


def test_fcfs_request_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=3)
    a, b = make_request("a", 7, max_tokens=4), make_request("b", 4, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: blocks 0, 1 (pos 7 still fits); b: block 2, full
    so, _ = step(sched)  # b's pos 4 needs a block: none free, b is the newest -> itself
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.preempted_req_ids == {"b"} and b.status is RequestStatus.PREEMPTED
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert sched.kv_manager.num_free_blocks == 1


def test_priority_preempts_lowest_priority_latest_arrival():
    sched = make_scheduler(num_blocks=5, policy="priority")
    reqs = {
        "a": make_request("a", 7, 4, priority=1, arrival=0.0),
        "b": make_request("b", 4, 4, priority=2, arrival=1.0),
        "c": make_request("c", 4, 4, priority=2, arrival=2.0),
        "d": make_request("d", 8, 4, priority=0, arrival=3.0),
    }
    for r in reqs.values():
        sched.add_request(r)
    so, _ = step(sched)  # admitted in priority order: d, a, then b (c doesn't fit)
    assert list(so.num_scheduled_tokens) == ["d", "a", "b"]
    so, _ = step(sched)  # d needs a block: victim is b (largest priority value, latest)
    assert so.preempted_req_ids == {"b"}
    assert reqs["b"].status is RequestStatus.PREEMPTED
    assert sched.running == [reqs["d"], reqs["a"]]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # back in priority order


def test_priority_unschedules_a_victim_already_scheduled_this_step():
    sched = make_scheduler(num_blocks=4, policy="priority")
    a = make_request("a", 6, 4, priority=5, arrival=0.0)
    sched.add_request(a)
    step(sched)  # a: blocks 0, 1; 7 tokens known
    b = make_request("b", 8, 4, priority=0, arrival=1.0)
    sched.add_request(b)
    step(sched)  # a decodes (pos 6), b prefills (blocks 2, 3)
    assert sched.running == [a, b]
    so = sched.schedule()  # a (pos 7) fits; b (pos 8) needs a block -> victim a
    assert so.num_scheduled_tokens == {"b": 1}
    assert so.total_num_scheduled_tokens == 1
    assert [c.request_id for c in so.scheduled_cached_reqs] == ["b"]
    assert so.scheduled_cached_reqs[0].new_block_ids == [1]  # a's blocks, freed tail first
    assert so.preempted_req_ids == {"a"} and so.finished_req_ids == {"a"}
    assert a.num_computed_tokens == 0 and a.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 9
    assert sched.kv_manager.get_block_ids("a") == []
    # a's output from before survives for the resume.
    assert a.output_token_ids == [SAMPLED, SAMPLED]


def test_unscheduled_victim_returns_its_budget_and_later_requests_still_run():
    sched = make_scheduler(num_blocks=5, policy="priority")
    a = make_request("a", 6, 4, priority=5, arrival=0.0)
    sched.add_request(a)
    step(sched)  # a: blocks 0, 1
    sched.add_request(make_request("b", 8, 4, priority=0, arrival=1.0))
    sched.add_request(make_request("c", 2, 4, priority=1, arrival=2.0))
    step(sched)  # a decodes; b: blocks 2, 3; c: block 4; the pool is full
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    # Two tokens of budget: a takes one, then b preempts a; a's token must come back for c.
    sched.config = replace(sched.config, max_num_batched_tokens=2)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"b": 1, "c": 1}
    assert so.scheduled_cached_reqs[0].new_block_ids == [1]
    assert so.preempted_req_ids == {"a"}


def test_no_admission_in_a_step_that_preempted():
    sched, a, b = two_full_requests()
    sched.add_request(make_request("c", 1))
    so, _ = step(sched)
    assert so.preempted_req_ids == {"b"}
    assert "c" not in so.num_scheduled_tokens


# ---- waiting-queue order ----------------------------------------------------------------


def so_ids(reqs: list[Request]) -> list[str]:
    return [r.request_id for r in reqs]


def test_fcfs_victim_goes_back_to_the_head_of_the_queue():
    sched = make_scheduler(num_blocks=4)
    a = make_request("a", 4, max_tokens=9, arrival=0.0)
    b = make_request("b", 3, max_tokens=2, arrival=1.0)
    c = make_request("c", 3, max_tokens=2, arrival=2.0)
    d = make_request("d", 3, max_tokens=2, arrival=3.0)
    for r in (a, b, c, d):
        sched.add_request(r)
    step(sched)  # one block each; a samples pos 4, the others pos 3
    sched.add_request(make_request("e", 2, max_tokens=2, arrival=4.0))
    # a needs a second block: d (newest) goes; the rest fit.
    so, _ = step(sched)
    assert so.preempted_req_ids == {"d"}
    assert so_ids(sched.waiting) == ["d", "e"]


def test_priority_waiting_order_is_priority_then_arrival():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    for rid, prio, arr in (("x", 2, 0.0), ("y", 0, 2.0), ("z", 0, 1.0), ("w", 1, 0.5)):
        sched.add_request(make_request(rid, 2, max_tokens=1, priority=prio, arrival=arr))
    assert so_ids(sched.waiting) == ["z", "y", "w", "x"]
    order = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        order += list(so.num_scheduled_tokens)
    assert order == ["z", "y", "w", "x"]
