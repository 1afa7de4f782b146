"""Scheduler basics with the real KV cache manager, exact block ids and token counts:
block allocation for prefill and decode, chunked prefill under the token budget and the
max_num_seqs limit, prefix-cache hits, admission (rejecting impossible requests, the
max_tokens default, queue limits and duplicate ids), and that the scheduler module stays
free of torch. Helpers live in `tests/support/scheduler_helpers.py`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.core.request import RequestStatus
from engine.errors import InvalidRequestError, QueueFullError
from tests.support.scheduler_helpers import (
    SAMPLED,
    block_ids,
    fake_runner_output,
    make_request,
    make_scheduler,
    step,
)

ROOT = Path(__file__).resolve().parents[2]


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


def test_prefix_query_of_a_blocked_head_of_queue_counts_once():
    """The hit rate must not read low under memory pressure: a request the pool can't admit
    yet is looked up every step, but only the lookup that admits it is counted."""
    sched = make_scheduler(num_blocks=4)
    a = make_request("a", list(range(100, 112)), max_tokens=5)  # 3 blocks, then a 4th
    sched.add_request(a)
    step(sched)
    b = make_request("b", list(range(100, 104)) + [500, 501, 502, 503], max_tokens=1)
    sched.add_request(b)
    blocked_steps = 0
    while b.status is RequestStatus.WAITING:
        step(sched)
        blocked_steps += 1
    assert blocked_steps > 2 and a.status is RequestStatus.FINISHED_LENGTH
    stats = sched.kv_manager.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (12 + 8, 4)
    assert b.num_cached_tokens == 4


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
    with pytest.raises(InvalidRequestError) as e:
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


def test_scheduler_module_does_not_import_torch():
    code = "import sys, engine.core.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_queueing_and_first_token_are_counted_in_engine_steps():
    """One seat: r1 queues while r0 runs its 3 tokens, is scheduled in the step after r0's
    last and gets its first token there; the step in flight when a request is queued counts."""
    sched = make_scheduler(max_num_seqs=1)
    r0, r1 = make_request("r0", 4, 3, ignore_eos=True), make_request("r1", 4, 2, ignore_eos=True)
    sched.add_request(r0)
    step(sched)  # step 1: r0's prefill (its first token)
    sched.add_request(r1)  # queued after step 1
    while sched.get_request("r0") is not None:
        step(sched)  # steps 2, 3: r0's decodes, r0 finishes
    step(sched)  # step 4: r1 admitted, its first token
    t0, t1 = r0.times, r1.times
    assert (t0.queued_step, t0.first_scheduled_step, t0.first_token_step) == (0, 1, 1)
    assert (t1.queued_step, t1.first_scheduled_step, t1.first_token_step) == (1, 4, 4)
