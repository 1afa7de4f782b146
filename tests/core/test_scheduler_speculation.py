"""The scheduler with speculative decoding: 1 + k tokens per decode within every limit, the
computed count and the blocks of rejected tokens given back, only accepted tokens in the
prefix cache, no preemption for proposals, worker-side proposals and a draft model's
lookahead slots, and no block held once a storm of requests is over.

A scripted proposer proposes fixed tokens; `verify` plays the runner, accepting a given
number of each request's proposals and adding the token after them.
"""

from __future__ import annotations

import random

from engine.config import SpeculativeConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.spec.speculator import Speculator
from engine.core.step_io import RunnerOutput, SchedulerOutput
from tests.support.scheduler_helpers import SAMPLED, block_ids, make_request, make_scheduler


class Scripted:
    """Proposes the first k of `tokens[request id]` (nothing for other ids)."""

    def __init__(self, tokens: dict[str, list[int]] | None = None):
        self.tokens = tokens or {}
        self.finished: list[str] = []

    def propose(self, req, state, k):
        return self.tokens.get(req.request_id, [])[:k]

    def on_finished(self, req):
        self.finished.append(req.request_id)


def spec_scheduler(tokens=None, k=3, method="ngram", **kw) -> tuple[Scheduler, Scripted]:
    proposer = Scripted(tokens)
    cfg = SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        adaptive=False,
        draft_model="unused" if method == "draft" else None,
        disable_by_batch_size=kw.pop("disable_by_batch_size", None),
    )
    return make_scheduler(speculator=Speculator(cfg, proposer), **kw), proposer


def verify(
    sched: Scheduler,
    so: SchedulerOutput,
    accept: dict[str, int] | None = None,
    bonus: int = SAMPLED,
    drafts: dict[str, list[int]] | None = None,
) -> list[Request]:
    """Results of `so`: each sampling request gets `accept[rid]` (default all) of its
    proposals and then `bonus`; `drafts`: worker-side proposals for the next step."""
    ids, toks = [], []
    for rid in so.num_scheduled_tokens:
        req = sched.get_request(rid)
        spec = so.spec_token_ids.get(rid, [])
        if req is None or req.num_computed_tokens != req.num_tokens + len(spec):
            continue
        a = (accept or {}).get(rid, len(spec))
        ids.append(rid)
        toks.append([*spec[:a], bonus])
    out = RunnerOutput(req_ids=ids, sampled_token_ids=toks, draft_token_ids=drafts or {})
    return sched.update_from_output(so, out)


def test_a_decode_schedules_its_proposals_after_its_last_token():
    sched, _ = spec_scheduler({"a": [1, 2, 3]})
    a = make_request("a", 8, max_tokens=10)
    sched.add_request(a)
    verify(sched, sched.schedule())  # prefill 8 (no proposals), samples 7
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and so.spec_token_ids == {"a": [1, 2, 3]}
    assert so.total_num_scheduled_tokens == 4
    assert block_ids(sched, "a") == [0, 1, 2]  # positions 8..11: a third block
    verify(sched, so)  # all three accepted, then 7
    assert a.output_token_ids == [SAMPLED, 1, 2, 3, SAMPLED]
    assert a.num_computed_tokens == a.num_tokens - 1 == 12
    st = a.spec
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 3, 3)


def test_rejected_tokens_give_back_their_slots_first_in_line_for_reuse():
    sched, _ = spec_scheduler({"a": [1, 2, 3]})
    a = make_request("a", 7, max_tokens=10)
    sched.add_request(a)
    verify(sched, sched.schedule())  # 8 tokens known, 7 computed
    so = sched.schedule()  # positions 7..10: blocks 0, 1 and a new 2
    assert block_ids(sched, "a") == [0, 1, 2]
    verify(sched, so, {"a": 0})  # all rejected: the correction 7 at position 8
    assert a.output_token_ids == [SAMPLED, SAMPLED] and a.num_computed_tokens == 8
    assert block_ids(sched, "a") == [0, 1]  # block 2 held only rejected positions
    head = next(iter(sched.kv_manager.pool.free_queue))
    assert head.block_id == 2  # reused before any block that may hold a cached prefix
    so = sched.schedule()
    assert so.scheduled_cached_reqs[0].num_blocks_kept == 2  # the runner drops block 2 too
    assert so.scheduled_cached_reqs[0].new_block_ids == [2]


def test_only_blocks_full_of_accepted_tokens_enter_the_prefix_cache():
    prompt = list(range(100, 106))
    sched, _ = spec_scheduler({"a": [1, 2, 3]})
    a = make_request("a", prompt, max_tokens=10)
    sched.add_request(a)
    verify(sched, sched.schedule())  # 7 known: block 0 full and cached
    assert sched.kv_manager.pool.num_cached_blocks == 1
    so = sched.schedule()  # 1, 2, 3 at positions 7..9 would fill block 1
    assert sched.kv_manager.pool.num_cached_blocks == 1  # not cached for proposals
    verify(sched, so, {"a": 1})  # 1 accepted, then 7: tokens 0..8 known
    sched.schedule()  # the next allocation registers block 1: [104, 105, 7, 1]
    assert sched.kv_manager.pool.num_cached_blocks == 2
    b = make_request("b", [*prompt, SAMPLED, 1, SAMPLED, 5])
    assert sched.kv_manager.get_computed_blocks(b)[1] == 8


def _second_step(sched: Scheduler, req: Request) -> SchedulerOutput:
    sched.add_request(req)
    verify(sched, sched.schedule())
    return sched.schedule()


def test_proposals_stay_within_budget_max_tokens_and_model_length():
    sched, _ = spec_scheduler({"a": [1, 2, 3], "b": [1, 2, 3]}, max_num_batched_tokens=3)
    sched.add_request(make_request("b", 2, max_tokens=10))
    so = _second_step(sched, make_request("a", 1, max_tokens=10))
    # b takes the whole budget of 3 (1 + 2 proposals); a gets nothing this step.
    assert so.num_scheduled_tokens == {"b": 3} and so.spec_token_ids == {"b": [1, 2]}
    sched, _ = spec_scheduler({"b": [1, 2, 3]})
    # 1 of 3 outputs so far: at most 1 proposal (1 + 1 tokens come back).
    assert _second_step(sched, make_request("b", 1, max_tokens=3)).spec_token_ids == {"b": [1]}
    sched, _ = spec_scheduler({"c": [1, 2, 3]}, max_model_len=6)
    # 3 computed of a model length of 6: 1 + 1 positions left to verify.
    assert _second_step(sched, make_request("c", 3, max_tokens=3)).spec_token_ids == {"c": [1]}


def test_proposals_never_cost_a_preemption():
    sched, _ = spec_scheduler({"a": [1, 2, 3], "b": [1]}, num_blocks=4)
    a = make_request("a", 6, max_tokens=8)
    b = make_request("b", 6, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    verify(sched, sched.schedule())  # a: blocks 0, 1; b: 2, 3; nothing free
    so = sched.schedule()
    # a's proposals (positions 7..9) would need a fifth block: a decodes without them; b's
    # one proposal fits its last block.
    assert so.num_scheduled_tokens == {"a": 1, "b": 2} and so.spec_token_ids == {"b": [1]}
    assert not so.preempted_req_ids and sched.num_preemptions == 0


def test_no_proposals_above_disable_by_batch_size():
    sched, _ = spec_scheduler({"a": [1], "b": [1]}, disable_by_batch_size=1)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, 3))
    verify(sched, sched.schedule())
    assert sched.schedule().spec_token_ids == {}


def test_a_stop_inside_the_accepted_run_ends_the_request_there():
    sched, proposer = spec_scheduler({"a": [1, 9, 3]})
    a = make_request("a", 3, max_tokens=10, eos=9)
    sched.add_request(a)
    verify(sched, sched.schedule())
    verify(sched, sched.schedule())  # 1 and EOS accepted: 3 and the bonus are dropped
    assert a.status is RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids == [SAMPLED, 1, 9]
    assert sched.kv_manager.num_free_blocks == sched.kv_manager.num_blocks
    assert proposer.finished == ["a"]


def test_an_abort_between_schedule_and_results_leaves_no_unwritten_block_cached():
    sched, _ = spec_scheduler({"a": [1, 2, 3, 4, 5]}, k=5)
    a = make_request("a", 3, max_tokens=20)
    sched.add_request(a)
    verify(sched, sched.schedule())
    sched.schedule()  # positions 3..8 scheduled: block 1 would fill with proposals
    sched.abort("a")
    assert sched.kv_manager.num_free_blocks == sched.kv_manager.num_blocks
    assert sched.kv_manager.pool.num_cached_blocks == 0


def test_worker_side_proposals_are_scheduled_the_next_step():
    sched, _ = spec_scheduler()
    a = make_request("a", 3, max_tokens=10)
    sched.add_request(a)
    verify(sched, sched.schedule(), drafts={"a": [4, 5]})
    so = sched.schedule()
    assert so.spec_token_ids == {"a": [4, 5]}
    verify(sched, so, {"a": 1})
    assert a.output_token_ids == [SAMPLED, 4, SAMPLED]
    assert sched.schedule().spec_token_ids == {}  # a proposal is used once


def test_a_draft_model_gets_lookahead_slots_that_are_given_back():
    sched, _ = spec_scheduler(method="draft", k=3)
    a = make_request("a", 3, max_tokens=10)
    sched.add_request(a)
    verify(sched, sched.schedule())  # prefill, 4 known
    so = sched.schedule()  # decode at position 3 and 3 lookahead slots (4..6)
    assert so.num_lookahead_tokens == {"a": 3} and so.num_scheduled_tokens == {"a": 1}
    assert block_ids(sched, "a") == [0, 1]
    verify(sched, so, drafts={"a": [4, 5, 6]})
    assert block_ids(sched, "a") == [0] and a.num_computed_tokens == 4
    so = sched.schedule()  # 1 + 3 proposals and 3 lookahead: positions 4..10
    assert so.spec_token_ids == {"a": [4, 5, 6]} and block_ids(sched, "a") == [0, 1, 2]
    verify(sched, so, {"a": 0})
    assert block_ids(sched, "a") == [0, 1] and a.num_computed_tokens == 5


def test_a_storm_with_speculation_leaves_no_block_held():
    """Random acceptance, EOS inside runs, aborts between steps, preemption by a tight pool,
    prefix hits (shared prompt heads) and worker-side proposals: once every request is done
    the pool has every block free and no unfinished request is left."""
    rng = random.Random(0)
    proposer = Scripted()
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    sched = make_scheduler(num_blocks=24, max_num_batched_tokens=32,
                           speculator=Speculator(cfg, proposer))  # fmt: skip
    head = [11, 12, 13, 14, 15, 16, 17, 18]
    for i in range(60):
        rid = f"r{i}"
        proposer.tokens[rid] = [rng.randrange(5) for _ in range(4)]
        prompt = head[: rng.randrange(9)] + [100 + i] * rng.randrange(1, 6)
        sched.add_request(make_request(rid, prompt, max_tokens=rng.randrange(1, 20), eos=3))
    steps = 0
    while sched.has_unfinished_requests():
        steps += 1
        so = sched.schedule()
        accept = {rid: rng.randrange(5) for rid in so.spec_token_ids}
        drafts = {rid: [rng.randrange(5)] for rid in so.num_scheduled_tokens if rng.random() < 0.2}
        verify(sched, so, accept, bonus=rng.randrange(5), drafts=drafts)
        if rng.random() < 0.05 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)
        assert steps < 2000
    kv = sched.kv_manager
    assert kv.num_free_blocks == kv.num_blocks and sched.num_preemptions > 0
    stats = sched.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
