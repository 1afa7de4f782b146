"""How scheduler requests end: stop conditions (EOS, ignore_eos, min_tokens, stop token
ids, max_tokens, max_model_len), freeing blocks and reporting a finished request once,
aborts of waiting, running, preempted, finished and unknown requests, and
`finish_requests` after a failed step or for stop strings. Helpers live in
`tests/support/scheduler_helpers.py`.
"""

from __future__ import annotations

import pytest

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from tests.support.scheduler_helpers import (
    fake_runner_output,
    make_request,
    make_scheduler,
    step,
    step_after_add,
    two_full_requests,
)

# ---- stop conditions ----------------------------------------------------------------------


def _run_until_done(sched: Scheduler, req: Request, tokens: list[int]) -> None:
    sched.add_request(req)
    for tok in tokens:
        step(sched, tok)
        if req.is_finished:
            return


def test_eos_stops_with_no_stop_reason():
    sched = make_scheduler()
    r = make_request("r", 4, eos=2)
    _run_until_done(sched, r, [5, 2, 5])
    assert (r.status, r.stop_reason, r.output_token_ids) == (
        RequestStatus.FINISHED_STOPPED,
        None,
        [5, 2],
    )
    assert r.times.finished is not None and r.times.first_token <= r.times.last_token


def test_ignore_eos_keeps_going_until_max_tokens():
    sched = make_scheduler()
    r = make_request("r", 4, max_tokens=3, eos=2, ignore_eos=True)
    _run_until_done(sched, r, [2, 2, 2, 2])
    assert (r.status, r.output_token_ids) == (RequestStatus.FINISHED_LENGTH, [2, 2, 2])


def test_min_tokens_suppresses_eos_and_stop_tokens():
    sched = make_scheduler()
    r = make_request("r", 4, eos=2, min_tokens=2, stop_token_ids=[9])
    _run_until_done(sched, r, [2, 9, 9])
    assert (r.status, r.stop_reason, r.output_token_ids) == (
        RequestStatus.FINISHED_STOPPED,
        9,
        [2, 9],
    )


def test_stop_token_id_sets_stop_reason():
    sched = make_scheduler()
    r = make_request("r", 4, stop_token_ids=[11, 12])
    _run_until_done(sched, r, [5, 12])
    assert (r.status, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, 12)


class _CountingIds(frozenset):
    """A frozenset that counts full passes over it (a list rebuild or an `in` over a list)."""

    passes = 0

    def __iter__(self):
        type(self).passes += 1
        return super().__iter__()


def test_stop_token_ids_are_a_set_read_by_membership_every_step():
    """Issue 19, finding 3: a million-long stop_token_ids list was scanned with `in` for
    every token of every sample. The ids are now one frozenset, checked by membership."""
    ids = _CountingIds(range(100, 1100))
    r = make_request("r", 4, max_tokens=None, stop_token_ids=ids)
    assert r.sampling_params.stop_token_ids is ids  # held as given: no copy, no list
    passes = _CountingIds.passes
    sched = make_scheduler()
    _run_until_done(sched, r, [5] * 30 + [1099])
    assert (r.status, r.stop_reason, r.num_output_tokens) == (
        RequestStatus.FINISHED_STOPPED,
        1099,
        31,
    )
    assert _CountingIds.passes == passes  # 31 checks, no pass over the ids


def test_stop_token_ids_are_deduplicated_once_into_a_frozenset():
    r = make_request("r", 4, stop_token_ids=[7] * 100_000 + [3])
    assert r.sampling_params.stop_token_ids == frozenset({3, 7})
    assert type(r.sampling_params.stop_token_ids) is frozenset


def test_max_tokens_finishes_with_length():
    sched = make_scheduler()
    r = make_request("r", 4, max_tokens=2)
    _run_until_done(sched, r, [5, 5, 5])
    assert (r.status, r.num_output_tokens) == (RequestStatus.FINISHED_LENGTH, 2)


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=10)
    r = make_request("r", 6, max_tokens=None)
    sched.add_request(r)
    assert r.max_tokens == 4
    r.max_tokens = 100  # isolate the max_model_len check
    for _ in range(10):
        step(sched)
    assert (r.status, r.num_tokens) == (RequestStatus.FINISHED_LENGTH, 10)


def test_finished_request_frees_blocks_and_is_reported_once():
    sched = make_scheduler(num_blocks=8)
    r = make_request("r", 5, max_tokens=1)
    _, updated = step_after_add(sched, r)
    assert updated == [r] and r.status is RequestStatus.FINISHED_LENGTH
    assert sched.kv_manager.num_free_blocks == 8
    assert sched.get_request("r") is None and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"r"}
    assert sched.schedule().finished_req_ids == set()


# ---- abort --------------------------------------------------------------------------------


def test_abort_waiting_request():
    sched = make_scheduler()
    r = make_request("r")
    sched.add_request(r)
    assert sched.abort("r") is r
    assert r.status is RequestStatus.FINISHED_ABORTED and r.times.finished is not None
    assert sched.num_waiting == 0 and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == set()  # the runner never saw it


def test_abort_running_request_frees_blocks_and_drops_late_tokens():
    sched = make_scheduler(num_blocks=8)
    r = make_request("r", 6)
    sched.add_request(r)
    so = sched.schedule()
    ro = fake_runner_output(sched, so)
    assert sched.abort("r") is r
    assert sched.kv_manager.num_free_blocks == 8 and sched.num_running == 0
    assert sched.update_from_output(so, ro) == []  # its sampled token is dropped
    assert r.output_token_ids == []
    assert sched.schedule().finished_req_ids == {"r"}


def test_abort_preempted_request_is_reported_to_the_runner():
    """The runner parks a preempted request's seeded generator; an abort while it waits
    must reach the runner, or the generator leaks to a later request reusing the id."""
    sched, a, b = two_full_requests()
    so, _ = step(sched)
    assert so.preempted_req_ids == {"b"}
    assert sched.abort("b") is b
    assert sched.num_waiting == 0 and b.status is RequestStatus.FINISHED_ABORTED
    assert sched.kv_manager.get_block_ids("b") == []
    so = sched.schedule()
    assert so.finished_req_ids == {"b"} and so.preempted_req_ids == set()


def test_abort_of_a_request_that_never_ran_is_not_reported():
    sched = make_scheduler()
    sched.add_request(make_request("w", 4))
    sched.abort("w")
    assert sched.schedule().finished_req_ids == set()


def test_abort_finished_or_unknown_request_returns_none():
    sched = make_scheduler()
    r = make_request("r", 4, max_tokens=1)
    step_after_add(sched, r)
    assert sched.abort("r") is None
    assert sched.abort("nope") is None


def test_abort_between_schedule_and_output_uncaches_unwritten_blocks():
    sched = make_scheduler(num_blocks=8)
    r = make_request("r", 8)
    sched.add_request(r)
    sched.schedule()  # the step fails: no update_from_output
    sched.finish_requests(["r"], RequestStatus.FINISHED_ERROR)
    again = make_request("again", r.prompt_token_ids)
    sched.add_request(again)
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # no hit on unwritten KV


def test_finish_requests_for_stop_strings_and_bad_status():
    sched = make_scheduler()
    r = make_request("r", 4)
    step_after_add(sched, r)
    assert sched.finish_requests("r", RequestStatus.FINISHED_STOPPED) == [r]
    assert r.status is RequestStatus.FINISHED_STOPPED
    with pytest.raises(ValueError):
        sched.finish_requests("x", RequestStatus.RUNNING)
