"""Scheduler support for n > 1 sampling: a forked request waits for its leader's prompt,
then shares the full prompt blocks and copies the partial one (copy-on-write, reported as
`block_copies` and `replaced_block_ids`); a fork whose leader is gone or preempted is
scheduled as an ordinary request. Helpers live in `tests/support/scheduler_helpers.py`.
"""

from __future__ import annotations

from engine.core.kv_cache.manager import BlockCopy
from tests.support.scheduler_helpers import (
    SAMPLED,
    block_ids,
    make_request,
    make_scheduler,
    step,
    step_after_add,
)

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
