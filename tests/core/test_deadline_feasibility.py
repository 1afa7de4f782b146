"""The `deadline` policy defers requests that can no longer make their deadline
(engine/core/policy/feasibility.py), on a fake clock where every step takes one second.

Under plain earliest-deadline-first the tightest request goes first even when its remaining
work cannot end in time; with deferral the request that can still make it goes first, the
late one keeps its place and expires in the queue with nothing computed, and a late request
still runs when a seat is free (work conservation). The same scenario with
`defer_late_requests: false` takes the late one first, so the test discriminates."""

from __future__ import annotations

from engine.core.policy.feasibility import StepTimer, is_late, steps_left
from engine.core.request import RequestStatus
from tests.support.scheduler_helpers import FakeClock, make_request, make_scheduler, step

STEP_S = 1.0


def _run(sched, clock, n: int) -> list[str]:
    """`n` steps of one second each; the ids admitted, in order."""
    admitted = []
    for _ in range(n):
        so, _ = step(sched)
        admitted += [d.request_id for d in so.scheduled_new_reqs]
        clock.advance(STEP_S)
    return admitted


def _warmed(defer: bool = True, max_num_seqs: int = 1):
    """A deadline scheduler that has seen busy one-second steps (its estimate is 1 s)."""
    clock = FakeClock()
    sched = make_scheduler(
        clock=clock, policy="deadline", max_num_seqs=max_num_seqs, defer_late_requests=defer
    )
    sched.add_request(make_request("warm", 8, 3, arrival=clock.now, ignore_eos=True))
    assert _run(sched, clock, 3) == ["warm"]
    assert not sched.has_unfinished_requests()
    return sched, clock


def test_the_step_timer_counts_only_intervals_that_ran_requests():
    t = StepTimer()
    t.step_started(0.0, busy=False)
    t.step_started(1.0, busy=True)  # the step at 0 admitted work: 1 s of it
    assert t.step_s == 1.0
    t.step_started(50.0, busy=False)  # idle gap: not a step time
    t.step_started(50.5, busy=True)
    assert t.step_s == 1.0 + 0.2 * (0.5 - 1.0)


def test_steps_left_counts_prefill_chunks_and_the_output_left():
    r = make_request("r", 100, 10)
    assert steps_left(r, chunk_tokens=64) == 2 + 9  # 2 chunks, the last samples token 1
    assert steps_left(make_request("u", 8, None), 64) is None  # no max_tokens: unknown
    late = make_request("late", 8, 10, deadline=5.0)
    assert is_late(late, now=0.0, step_s=1.0, chunk_tokens=64)  # 10 steps > 5 s
    assert not is_late(late, now=0.0, step_s=0.4, chunk_tokens=64)
    assert not is_late(late, now=0.0, step_s=None, chunk_tokens=64)  # no estimate yet


def _tight_and_loose(sched, clock):
    t = clock.now
    # tight: 10 steps of work, 4 s left; loose: 10 steps, 100 s left.
    sched.add_request(make_request("tight", 8, 10, arrival=t, deadline=t + 4, ignore_eos=True))
    sched.add_request(make_request("loose", 8, 10, arrival=t, deadline=t + 100, ignore_eos=True))


def test_a_request_that_cannot_make_its_deadline_waits_behind_one_that_can():
    sched, clock = _warmed()
    _tight_and_loose(sched, clock)
    admitted = _run(sched, clock, 12)
    assert admitted == ["loose"]
    ((req, _),) = sched.take_dropped()
    assert req.request_id == "tight" and req.num_computed_tokens == 0
    assert req.times.first_scheduled is None
    assert sched.get_request("loose") is None  # finished, all 10 tokens


def test_without_deferral_the_late_request_goes_first_and_its_compute_is_lost():
    sched, clock = _warmed(defer=False)
    _tight_and_loose(sched, clock)
    admitted = _run(sched, clock, 6)
    assert admitted[0] == "tight"
    ((req, _),) = sched.take_dropped()
    assert req.request_id == "tight" and req.num_computed_tokens > 0  # stopped part way


def test_a_late_request_still_runs_when_a_seat_is_free():
    sched, clock = _warmed(max_num_seqs=2)
    _tight_and_loose(sched, clock)
    so, _ = step(sched)
    assert {d.request_id for d in so.scheduled_new_reqs} == {"tight", "loose"}
    assert sched.get_request("tight").status is RequestStatus.RUNNING


def test_a_request_without_max_tokens_is_never_judged_late():
    sched, clock = _warmed()
    t = clock.now
    sched.add_request(make_request("open", 8, None, arrival=t, deadline=t + 2))
    sched.add_request(make_request("loose", 8, 3, arrival=t, deadline=t + 100))
    so, _ = step(sched)
    assert [d.request_id for d in so.scheduled_new_reqs] == ["open"]
