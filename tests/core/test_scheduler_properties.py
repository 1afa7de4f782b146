"""Property tests: random add / step / abort / stop / failed-step sequences on small pools.

Besides the block bookkeeping, a fake runner mirrors what the real one would hold: each
request's block table, rebuilt only from `SchedulerOutput` diffs, and the KV content of
every slot (the token prefix it was computed from). After each step every scheduled request
must read exactly its own prefix from its own table, which catches wrong diffs, a prefix
hit or fork on unwritten KV, and a copy-on-write gone missing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from engine.config import SchedulerConfig
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.step_io import RunnerOutput, SchedulerOutput
from engine.errors import InvalidRequestError, QueueFullError
from engine.sampling_params import SamplingParams

EOS, STOP, PLAIN = 2, 3, 7


@dataclass
class FakeRunner:
    """The runner's view: tables from diffs, KV slot contents, computed counts."""

    block_size: int
    tables: dict[str, list[int]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    kv: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)

    def apply(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
            self.computed.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.request_id not in self.tables
            self.tables[new.request_id] = list(new.block_ids)
            self.computed[new.request_id] = new.num_computed_tokens
        for c in so.scheduled_cached_reqs:
            table = self.tables[c.request_id]
            assert self.computed[c.request_id] == c.num_computed_tokens
            for index, dst in c.replaced_block_ids:
                table[index] = dst
            table.extend(c.new_block_ids)
        assert set(so.num_scheduled_tokens) == {r.request_id for r in so.scheduled_new_reqs} | {
            c.request_id for c in so.scheduled_cached_reqs
        }

    def execute(self, so: SchedulerOutput, sched: Scheduler) -> None:
        """Copy, then write every scheduled token's KV, then check every read range."""
        bs = self.block_size
        snapshot = dict(self.kv)
        for src, dst in so.block_copies:
            for off in range(bs):
                if (src, off) in snapshot:
                    self.kv[(dst, off)] = snapshot[(src, off)]
                else:
                    self.kv.pop((dst, off), None)
        for rid, n in so.num_scheduled_tokens.items():
            tokens = sched.get_request(rid).all_token_ids
            table, start = self.tables[rid], self.computed[rid]
            for p in range(start, start + n):
                self.kv[(table[p // bs], p % bs)] = tuple(tokens[: p + 1])
        for rid, n in so.num_scheduled_tokens.items():
            tokens = sched.get_request(rid).all_token_ids
            table = self.tables[rid]
            self.computed[rid] += n
            for p in range(self.computed[rid]):
                assert self.kv.get((table[p // bs], p % bs)) == tuple(tokens[: p + 1]), (rid, p)


def check_invariants(sched: Scheduler, cfg: SchedulerConfig) -> None:
    kv = sched.kv_manager
    pool = kv.pool
    free = {b.block_id for b in pool.free_queue}
    assert len(free) == kv.num_free_blocks
    refs = [0] * kv.num_blocks
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        for b in kv.get_block_ids(req.request_id):
            refs[b] += 1
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert kv.get_block_ids(req.request_id) == []
        assert req.num_computed_tokens == 0
    for block in pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == refs[block.block_id]  # no leaked or stray references
        assert (block.ref_cnt == 0) == (block.block_id in free)  # never both free and used
    assert len(sched.running) <= cfg.max_num_seqs
    assert len(sched.running) + len(sched.waiting) == len(sched.requests)


def check_output(so: SchedulerOutput, sched: Scheduler, cfg: SchedulerConfig) -> None:
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    assert so.preempted_req_ids <= so.finished_req_ids
    assert not so.preempted_req_ids & set(so.num_scheduled_tokens)
    for rid in so.num_scheduled_tokens:
        req = sched.get_request(rid)
        assert req.num_computed_tokens <= min(req.num_tokens, sched.max_model_len)


def sample(so: SchedulerOutput, sched: Scheduler, rng: random.Random) -> RunnerOutput:
    ids = [
        rid
        for rid in so.num_scheduled_tokens
        if sched.get_request(rid).num_computed_tokens == sched.get_request(rid).num_tokens
    ]
    toks = [[rng.choice((EOS, STOP, PLAIN, PLAIN, PLAIN, PLAIN, PLAIN, PLAIN))] for _ in ids]
    return RunnerOutput(req_ids=ids, sampled_token_ids=toks)


class Driver:
    def __init__(self, cfg: SchedulerConfig, num_blocks: int, bs: int, max_len: int, pc: bool):
        self.cfg = cfg
        self.sched = Scheduler(cfg, KVCacheManager(num_blocks, bs, pc), max_len)
        self.runner = FakeRunner(bs)
        self.added: list[Request] = []
        self.rng = random.Random(0)

    def add(self, prompt: list[int], max_tokens: int, priority: int, n: int, min_t: int) -> None:
        gid = len(self.added)
        group = []
        for j in range(n):
            sp = SamplingParams(
                max_tokens=max_tokens, min_tokens=min(min_t, max_tokens), stop_token_ids=[STOP]
            )
            group.append(
                Request(
                    f"{gid}#{j}",
                    prompt,
                    sp,
                    eos_token_ids=frozenset({EOS}),
                    priority=priority,
                    fork_from=None if j == 0 else f"{gid}#0",
                )
            )
        done = []
        try:
            for req in group:
                self.sched.add_request(req)
                done.append(req)
        except (InvalidRequestError, QueueFullError):
            for req in done:
                self.sched.abort(req.request_id)
        self.added.extend(done)

    def step(self) -> None:
        so = self.sched.schedule()
        check_output(so, self.sched, self.cfg)
        check_invariants(self.sched, self.cfg)
        self.runner.apply(so)
        assert set(self.runner.tables) == {r.request_id for r in self.sched.running}
        self.runner.execute(so, self.sched)
        self.sched.update_from_output(so, sample(so, self.sched, self.rng))
        check_invariants(self.sched, self.cfg)

    def failed_step(self) -> None:
        """The forward raised: nothing written, every scheduled request fails."""
        so = self.sched.schedule()
        self.runner.apply(so)
        self.sched.finish_requests(list(so.num_scheduled_tokens), RequestStatus.FINISHED_ERROR)
        check_invariants(self.sched, self.cfg)

    def finish_one(self, index: int, status: RequestStatus) -> None:
        if self.added:
            req = self.added[index % len(self.added)]
            self.sched.finish_requests(req.request_id, status)
            check_invariants(self.sched, self.cfg)


# Prompts share prefixes of a common base often enough for prefix hits.
BASE = [20, 21, 22, 23, 24, 25, 26, 27, 28]
prompts = st.builds(
    lambda k, tail: (BASE[:k] + tail) or [10],
    st.integers(0, len(BASE)),
    st.lists(st.integers(10, 12), max_size=6),
)
add_op = st.tuples(
    st.just("add"),
    prompts,
    st.integers(1, 8),  # max_tokens
    st.integers(0, 2),  # priority
    st.sampled_from([1, 1, 2, 3]),  # n
    st.integers(0, 3),  # min_tokens
)
ops = st.one_of(
    add_op,
    add_op,
    add_op,
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("stop"), st.integers(0, 50)),
    st.tuples(st.just("fail")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seq=st.lists(ops, min_size=10, max_size=60),
    bs=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(3, 12),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 5),
    policy=st.sampled_from(["fcfs", "priority"]),
    max_len=st.integers(10, 32),
    pc=st.booleans(),
)
def test_random_sequences_keep_invariants_and_drain(
    seq, bs, num_blocks, budget, max_seqs, policy, max_len, pc
):
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy, max_queue_len=8
    )
    d = Driver(cfg, num_blocks, bs, max_len, pc)
    for op in seq:
        if op[0] == "add":
            d.add(*op[1:])
        elif op[0] == "step":
            d.step()
        elif op[0] == "abort":
            d.finish_one(op[1], RequestStatus.FINISHED_ABORTED)
        elif op[0] == "stop":
            d.finish_one(op[1], RequestStatus.FINISHED_STOPPED)
        else:
            d.failed_step()
    # Without new arrivals every request finishes and every block is free again.
    for _ in range(2000):
        if not d.sched.has_unfinished_requests():
            break
        d.step()
    assert not d.sched.has_unfinished_requests()
    assert all(r.is_finished for r in d.added)
    kv = d.sched.kv_manager
    assert kv.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert d.sched.num_running == d.sched.num_waiting == 0
    # Steer the search toward the interesting paths: memory pressure, hits, forks.
    target(float(d.sched.num_preemptions), label="preemptions")
    target(float(kv.stats().prefix_hits), label="prefix hits")
    target(float(sum(bool(r.fork_from and r.num_cached_tokens) for r in d.added)), label="forks")
