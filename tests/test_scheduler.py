"""Scheduler behaviour with the real KV cache manager, exact block ids and token counts.

Block ids: the pool hands out 0, 1, 2, ... from the head of its free queue; `free` returns a
request's blocks tail first to the tail of the queue. Most tests use block_size 4.
"""

from __future__ import annotations

import subprocess
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import SchedulerConfig
from engine.errors import InvalidRequestError
from engine.kv_cache.manager import BlockCopy, KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFullError, RequestRejectedError, Scheduler
from engine.step_io import RunnerOutput, SchedulerOutput

ROOT = Path(__file__).resolve().parent.parent

SAMPLED = 7  # the fake runner samples this token for every request


def make_request(
    request_id: str,
    prompt: int | list[int] = 8,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival: float | None = None,
    *,
    eos: int | None = None,
    fork_from: str | None = None,
    **params,
) -> Request:
    """A request whose prompt is `prompt` tokens unique to its id (no accidental prefix hits),
    or the given token list."""
    if isinstance(prompt, int):
        base = 1000 + (zlib.crc32(request_id.encode()) % 100_000) * 1000
        prompt = list(range(base, base + prompt))
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(
        request_id,
        prompt,
        sp,
        eos_token_id=eos,
        arrival_time=arrival,
        priority=priority,
        fork_from=fork_from,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    policy: str = "fcfs",
    max_model_len: int = 256,
    max_queue_len: int = 64,
    prefix_caching: bool = True,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=policy,
        max_queue_len=max_queue_len,
    )
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(cfg, kv, max_model_len)


def fake_runner_output(
    sched: Scheduler, so: SchedulerOutput, token: int | dict[str, int] = SAMPLED
) -> RunnerOutput:
    """Samples `token` for every scheduled request whose known tokens are all computed."""
    ids = []
    for rid in so.num_scheduled_tokens:
        req = sched.get_request(rid)
        if req is not None and req.num_computed_tokens == req.num_tokens:
            ids.append(rid)
    toks = [[token[r] if isinstance(token, dict) else token] for r in ids]
    return RunnerOutput(req_ids=ids, sampled_token_ids=toks)


def step(
    sched: Scheduler, token: int | dict[str, int] = SAMPLED
) -> tuple[SchedulerOutput, list[Request]]:
    so = sched.schedule()
    return so, sched.update_from_output(so, fake_runner_output(sched, so, token))


def block_ids(sched: Scheduler, rid: str) -> list[int]:
    return sched.kv_manager.get_block_ids(rid)


# ---- allocation and chunked prefill -------------------------------------------------------


def test_first_step_schedules_whole_prompts_with_exact_block_ids():
    sched = make_scheduler()
    a, b = make_request("a", 6), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 6, "b": 5}
    assert so.total_num_scheduled_tokens == 11
    assert [(n.request_id, n.block_ids, n.num_computed_tokens) for n in so.scheduled_new_reqs] == [
        ("a", [0, 1], 0),
        ("b", [2, 3], 0),
    ]
    assert so.scheduled_new_reqs[0].prompt_token_ids == a.prompt_token_ids
    assert so.scheduled_new_reqs[0].output_token_ids == []
    assert so.scheduled_cached_reqs == []
    assert so.block_copies == [] and so.finished_req_ids == set()
    # num_computed_tokens advances at schedule time.
    assert (a.num_computed_tokens, b.num_computed_tokens) == (6, 5)
    assert a.status is RequestStatus.RUNNING and a.times.first_scheduled is not None
    assert (sched.num_running, sched.num_waiting) == (2, 0)


def test_decode_appends_a_block_only_when_crossing_a_boundary():
    sched = make_scheduler()
    a = make_request("a", 7)
    sched.add_request(a)
    _, updated = step(sched)  # prefill 7 -> samples token 8 (position 7)
    assert updated == [a] and a.output_token_ids == [SAMPLED]
    so, _ = step(sched)  # position 7 still fits block 1
    assert so.num_scheduled_tokens == {"a": 1}
    (c,) = so.scheduled_cached_reqs
    assert (c.request_id, c.new_block_ids, c.replaced_block_ids, c.num_computed_tokens) == (
        "a",
        [],
        [],
        7,
    )
    so, _ = step(sched)  # position 8 needs a third block
    assert so.scheduled_cached_reqs[0].new_block_ids == [2]
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 8
    assert block_ids(sched, "a") == [0, 1, 2]
    assert a.num_output_tokens == 3


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 20)
    sched.add_request(a)
    chunks = []
    for _ in range(3):
        so, updated = step(sched)
        chunks.append((so.num_scheduled_tokens["a"], a.num_computed_tokens, updated))
    assert chunks == [(8, 8, []), (8, 16, []), (4, 20, [a])]
    assert a.output_token_ids == [SAMPLED]
    # The request is new only in its first step, then a cached diff with appended blocks.
    assert block_ids(sched, "a") == [0, 1, 2, 3, 4]


def test_step_mixes_a_prefill_chunk_with_decodes():
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # both prefilled, each sampled one token
    c = make_request("c", 30)
    sched.add_request(c)
    so, updated = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 8}
    assert [n.request_id for n in so.scheduled_new_reqs] == ["c"]
    assert [r.request_id for r in so.scheduled_cached_reqs] == ["a", "b"]
    assert updated == [a, b]  # c's chunk stops short: it samples nothing
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 8}
    assert so.scheduled_cached_reqs[2].num_computed_tokens == 8


def test_budget_and_max_num_seqs_are_never_exceeded():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=16)
    reqs = [make_request(f"r{i}", 10, max_tokens=4) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r0": 10, "r1": 6}  # r1 chunked to the budget left
    sched.update_from_output(so, fake_runner_output(sched, so))
    so = sched.schedule()
    # 1 token of budget is left, but all 3 seats are taken.
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 4, "r2": 10}
    assert so.total_num_scheduled_tokens == 15
    assert (sched.num_running, sched.num_waiting) == (3, 3)


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=2))
    so, _ = step(sched)
    assert list(so.num_scheduled_tokens) == ["r0", "r1"]
    assert (sched.num_running, sched.num_waiting) == (2, 2)
    so, _ = step(sched)  # r0 and r1 decode their 2nd and last token
    assert list(so.num_scheduled_tokens) == ["r0", "r1"]
    so, _ = step(sched)
    assert list(so.num_scheduled_tokens) == ["r2", "r3"]
    assert so.finished_req_ids == {"r0", "r1"}


# ---- prefix cache -------------------------------------------------------------------------


def test_second_request_hits_the_shared_prompt_prefix():
    sched = make_scheduler()
    shared = list(range(100, 110))  # 10 tokens: 2 full blocks
    a = make_request("a", shared)
    sched.add_request(a)
    step(sched)
    b = make_request("b", shared[:8] + [500, 501, 502])
    sched.add_request(b)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 3}
    (nb,) = so.scheduled_new_reqs
    assert (nb.block_ids, nb.num_computed_tokens) == ([0, 1, 3], 8)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 11
    assert a.num_cached_tokens == 0


def test_full_prefix_hit_still_computes_the_last_token():
    sched = make_scheduler()
    prompt = list(range(100, 108))
    sched.add_request(make_request("a", prompt))
    step(sched)
    b = make_request("b", prompt)
    sched.add_request(b)
    so, _ = step(sched)
    assert so.num_scheduled_tokens["b"] == 4  # the hit stops one block short
    assert b.num_cached_tokens == 4


# ---- preemption ---------------------------------------------------------------------------


def _two_full_requests(policy: str = "fcfs") -> tuple[Scheduler, Request, Request]:
    """4 blocks of 4: a and b each prefill 8 tokens (2 blocks) and sample once."""
    sched = make_scheduler(num_blocks=4, policy=policy)
    a = make_request("a", 8, max_tokens=3, arrival=0.0)
    b = make_request("b", 8, max_tokens=8, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert block_ids(sched, "a") == [0, 1] and block_ids(sched, "b") == [2, 3]
    return sched, a, b


def test_fcfs_preempts_the_newest_running_request():
    sched, a, b = _two_full_requests()
    so, _ = step(sched)  # a needs a third block: b (newest) is preempted
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.preempted_req_ids == {"b"} and so.finished_req_ids == {"b"}
    assert so.scheduled_cached_reqs[0].new_block_ids == [3]  # b's blocks freed tail first
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and len(b.times.preempted) == 1
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and sched.running == [a]


def test_preempted_request_resumes_with_same_tokens():
    sched, a, b = _two_full_requests()
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
    sched, a, b = _two_full_requests()
    sched.add_request(make_request("c", 1))
    so, _ = step(sched)
    assert so.preempted_req_ids == {"b"}
    assert "c" not in so.num_scheduled_tokens


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


def step_after_add(sched: Scheduler, req: Request) -> tuple[SchedulerOutput, list[Request]]:
    sched.add_request(req)
    return step(sched)


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


def test_abort_preempted_request():
    sched, a, b = _two_full_requests()
    step(sched)  # b preempted (reported then)
    assert sched.abort("b") is b
    assert sched.num_waiting == 0 and b.status is RequestStatus.FINISHED_ABORTED
    assert sched.kv_manager.get_block_ids("b") == []
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


# ---- admission ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "param"),
    [
        (20, 1, "prompt"),  # prompt alone leaves no room (max_model_len 20)
        (15, 6, "max_tokens"),  # 21 > 20
        (17, None, "prompt"),  # pool: 4 blocks of 4 = 16 tokens of K/V
        (10, 8, "max_tokens"),  # needs K/V for 17 tokens
    ],
)
def test_impossible_requests_are_rejected(prompt, max_tokens, param):
    sched = make_scheduler(num_blocks=4, max_model_len=20)
    with pytest.raises(RequestRejectedError) as e:
        sched.add_request(make_request("r", prompt, max_tokens=max_tokens))
    assert e.value.param == param
    assert isinstance(e.value, InvalidRequestError) and isinstance(e.value, ValueError)
    assert not sched.has_unfinished_requests()


def test_request_filling_the_whole_pool_is_accepted_and_finishes():
    sched = make_scheduler(num_blocks=4, max_model_len=20)
    r = make_request("r", 10, max_tokens=7)  # K/V for 16 tokens: exactly the pool
    sched.add_request(r)
    for _ in range(10):
        step(sched)
    assert r.status is RequestStatus.FINISHED_LENGTH


def test_max_tokens_none_takes_the_context_left():
    sched = make_scheduler(max_model_len=64)
    r = make_request("r", 10, max_tokens=None)
    sched.add_request(r)
    assert r.max_tokens == 54


def test_queue_full_and_duplicate_id():
    sched = make_scheduler(max_queue_len=2)
    sched.add_request(make_request("a"))
    with pytest.raises(ValueError):
        sched.add_request(make_request("a"))
    sched.add_request(make_request("b"))
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("c"))
    assert isinstance(QueueFullError("x"), RuntimeError)


# ---- n > 1 fork ---------------------------------------------------------------------------


def test_fork_waits_for_leader_then_shares_prompt_blocks_with_copy_on_write():
    sched = make_scheduler()
    lead = make_request("s#0", 6)
    child = make_request("s#1", lead.prompt_token_ids, fork_from="s#0")
    other = make_request("o", 4)
    for r in (lead, child, other):
        sched.add_request(r)
    so, _ = step(sched)  # the leader starts this step: the child waits, not blocking `o`
    assert so.num_scheduled_tokens == {"s#0": 6, "o": 4}
    assert [r.request_id for r in sched.waiting] == ["s#1"]
    assert block_ids(sched, "s#0") == [0, 1]
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"s#0": 1, "o": 1, "s#1": 1}
    (nc,) = so.scheduled_new_reqs
    # Shares block 0, copies the partial block 1 (positions 4, 5) into a fresh block 4
    # (block 3 went to o's decode, scheduled first).
    assert (nc.request_id, nc.block_ids, nc.num_computed_tokens) == ("s#1", [0, 4], 5)
    assert so.block_copies == [(1, 4)]
    assert child.num_computed_tokens == 6 and child.num_cached_tokens == 5
    assert child.output_token_ids == [SAMPLED]


def test_fork_when_leader_mid_prefill_waits_until_next_step():
    sched = make_scheduler(max_num_batched_tokens=4)
    lead = make_request("s#0", 6)
    child = make_request("s#1", lead.prompt_token_ids, fork_from="s#0")
    sched.add_request(lead)
    sched.add_request(child)
    so, _ = step(sched)  # leader chunk 4
    assert so.num_scheduled_tokens == {"s#0": 4}
    so, _ = step(sched)  # leader's last 2 prompt tokens; at step start it had 4 < 5
    assert so.num_scheduled_tokens == {"s#0": 2}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"s#0": 1, "s#1": 1}
    assert so.block_copies == [(1, 2)]


def test_fork_from_a_gone_leader_is_an_ordinary_request():
    sched = make_scheduler()
    lead = make_request("s#0", 6)
    child = make_request("s#1", lead.prompt_token_ids, fork_from="s#0")
    sched.add_request(lead)
    sched.add_request(child)
    step(sched)
    sched.abort("s#0")
    so, _ = step(sched)
    (nc,) = so.scheduled_new_reqs
    # The leader's full first block is still cached: an ordinary prefix hit.
    assert (nc.num_computed_tokens, so.num_scheduled_tokens) == (4, {"s#1": 2})
    assert so.block_copies == []


def test_replaced_block_ids_report_copy_on_write_of_running_requests(monkeypatch):
    sched = make_scheduler()
    r = make_request("r", 4)
    step_after_add(sched, r)
    real_take = sched.kv_manager.take_block_copies
    monkeypatch.setattr(
        sched.kv_manager,
        "take_block_copies",
        lambda: real_take() + [BlockCopy("r", 0, 0, 9)],
    )
    so = sched.schedule()
    assert so.scheduled_cached_reqs[0].replaced_block_ids == [(0, 9)]
    assert so.block_copies == [(0, 9)]


def test_fork_from_a_preempted_leader_is_an_ordinary_request():
    # Priority policy with the sample ahead of its leader (an artificial priority) is the one
    # way to meet a preempted leader: under FCFS a preempted leader is back at the head.
    sched = make_scheduler(num_blocks=4, policy="priority")
    o = make_request("o", 8, max_tokens=2, priority=0, arrival=0.0)
    lead = make_request("s#0", 6, max_tokens=2, priority=1, arrival=1.0)
    child = make_request(
        "s#1", lead.prompt_token_ids, max_tokens=2, priority=0, arrival=1.0, fork_from="s#0"
    )
    for r in (o, lead, child):
        sched.add_request(r)
    so, _ = step(sched)  # o: blocks 0, 1; the child waits for its leader; s#0: blocks 2, 3
    assert so.num_scheduled_tokens == {"o": 8, "s#0": 6}
    so, _ = step(sched)  # o's pos 8 needs a block: s#0 is preempted; o finishes
    assert so.preempted_req_ids == {"s#0"} and o.is_finished
    so, _ = step(sched)
    # The child goes first, as an ordinary request hitting the leader's cached first block.
    assert so.num_scheduled_tokens == {"s#1": 2, "s#0": 3}
    nc = so.scheduled_new_reqs[0]
    assert (nc.request_id, nc.block_ids, nc.num_computed_tokens) == ("s#1", [2, 3], 4)
    assert so.block_copies == []


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


def test_scheduler_module_does_not_import_torch():
    code = "import sys, engine.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
