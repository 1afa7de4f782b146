"""Property tests of the KV tiers in the core: random workloads on small pools behind a host
and a disk tier whose worker reports copies, stores and loads after random delays, fails
some loads, and where requests are aborted mid-load.

The fake runner of `test_scheduler_properties` keeps the KV content of every pool slot (the
token prefix it was computed from) and checks that every scheduled request reads exactly
its own prefix. The fake tier worker here moves that content for real: a save copies the
block's slots when submitted (before the step writes anything, as the worker's copy thread
does), a host slot is overwritten by the next save into it, a disk write reads the host slot
(or its staging copy) only when it runs, and a load writes the stored content into the pool
block when it completes. So a block reused before its copy, a slot reused under a pending
disk write, a load into a block someone reads, or a hit on the wrong content all fail the
read check. At the end everything drains: no request, no move, every block free.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from engine.config import SchedulerConfig
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.kv_tier.manager import KVTierManager, TierSizes
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.step_io import DISK_TIER, HOST_TIER, KVTierReport, SchedulerOutput
from engine.errors import InvalidRequestError, QueueFullError
from engine.sampling_params import SamplingParams
from tests.core.test_scheduler_properties import FakeRunner, check_output, sample

Content = tuple  # one block's slots: per offset, the token prefix it was computed from


@dataclass
class ContentTierWorker:
    """Carries out tier moves on the fake runner's KV content, after random delays."""

    runner: FakeRunner
    rng: random.Random
    fail_rate: float
    host: dict[int, Content] = field(default_factory=dict)
    disk: dict[bytes, Content] = field(default_factory=dict)
    copies: list[int] = field(default_factory=list)
    stores: list[tuple] = field(default_factory=list)  # (hash, tier, source) pending
    loads: list = field(default_factory=list)

    def _block(self, block_id: int) -> Content:
        kv, bs = self.runner.kv, self.runner.block_size
        return tuple(kv.get((block_id, off)) for off in range(bs))

    def submit(self, so: SchedulerOutput) -> None:
        for h in so.kv_deletes:
            self.disk.pop(h, None)
        for m in so.kv_saves:
            content = self._block(m.block_id)  # copied before this step writes anything
            assert all(c is not None for c in content), "saving an unwritten block"
            self.copies.append(m.block_id)
            if m.host_slot >= 0:
                self.host[m.host_slot] = content
                self.stores.append((m.block_hash, HOST_TIER, None))
            if m.to_disk:  # reads the host slot when it runs, else its staging copy
                src = ("slot", m.host_slot) if m.host_slot >= 0 else ("copy", content)
                self.stores.append((m.block_hash, DISK_TIER, src))
        self.loads.extend(so.kv_loads)

    def report(self, everything: bool = False) -> KVTierReport | None:
        r = KVTierReport()
        rng = self.rng

        def due() -> bool:
            return everything or rng.random() < 0.5

        keep = []
        for bid in self.copies:
            (r.copied.append(bid) if due() else keep.append(bid))
        self.copies = keep
        keep = []
        for h, tier, src in self.stores:
            if not due():
                keep.append((h, tier, src))
                continue
            if tier == DISK_TIER:
                kind, value = src
                self.disk[h] = self.host[value] if kind == "slot" else value
            r.stored.append((h, tier))
        self.stores = keep
        keep = []
        for m in self.loads:
            if not due():
                keep.append(m)
                continue
            content = (
                self.host.get(m.host_slot) if m.host_slot >= 0 else self.disk.get(m.block_hash)
            )
            if content is None or rng.random() < self.fail_rate:
                r.load_failed.append((m.block_id, "missing or corrupt"))
                continue
            for off, c in enumerate(content):
                self.runner.kv[(m.block_id, off)] = c
            r.loaded.append(m.block_id)
        self.loads = keep
        return r if r else None


def check_tier_invariants(sched: Scheduler) -> None:
    """Every reference is a table's or a loading request's pin; the free queue holds exactly
    the unreferenced blocks not held for saving."""
    kv, tier = sched.kv_manager, sched.kv_tier
    pool = kv.pool
    refs = [0] * kv.num_blocks
    for req in sched.running:
        for b in kv.get_block_ids(req.request_id):
            refs[b] += 1
    for job in tier._jobs.values():  # a loading request pins its prefix and its targets
        if job.pending:
            for b in job.prefix + job.targets:
                refs[b.block_id] += 1
    for job, k in tier._loading.values():  # its request left: the block being filled
        if job.gone:
            refs[job.targets[k].block_id] += 1
    free = {b.block_id for b in pool.free_queue}
    for block in pool.blocks:
        assert block.ref_cnt == refs[block.block_id], (block, refs[block.block_id])
        in_queue = block.block_id in free
        assert in_queue == (block.ref_cnt == 0 and not block.save_pending), block
    assert pool.num_held_for_save == sum(b.save_pending for b in pool.blocks)
    if tier.disk is not None:
        assert tier.disk.used_bytes <= tier.disk.capacity_bytes
    for req in sched.waiting:
        assert kv.get_block_ids(req.request_id) == []


class TierDriver:
    def __init__(self, cfg, num_blocks, bs, max_len, host_slots, disk_blocks, fail_rate, seed):
        self.cfg = cfg
        kv = KVCacheManager(num_blocks, bs)
        sizes = TierSizes(
            host_slots=host_slots, host_block_bytes=10,
            disk_capacity_bytes=disk_blocks * 10, disk_file_bytes=10,
        )  # fmt: skip
        self.sched = Scheduler(cfg, kv, max_len, kv_tier=KVTierManager(kv, sizes))
        self.rng = random.Random(seed)
        self.runner = FakeRunner(bs)
        self.worker = ContentTierWorker(self.runner, self.rng, fail_rate)
        self.added: list[Request] = []

    def add(self, prompt: list[int], max_tokens: int) -> None:
        req = Request(f"r{len(self.added)}", prompt, SamplingParams(max_tokens=max_tokens))
        try:
            self.sched.add_request(req)
        except (InvalidRequestError, QueueFullError):
            return
        self.added.append(req)

    def step(self, everything: bool = False) -> None:
        so = self.sched.schedule()
        check_output(so, self.sched, self.cfg)
        self.runner.apply(so)
        self.worker.submit(so)
        self.runner.execute(so, self.sched)
        out = sample(so, self.sched, self.rng)
        out.kv_tier = self.worker.report(everything)
        self.sched.update_from_output(so, out)
        check_tier_invariants(self.sched)

    def abort(self, index: int) -> None:
        if self.added:
            self.sched.finish_requests(
                self.added[index % len(self.added)].request_id, RequestStatus.FINISHED_ABORTED
            )
            check_tier_invariants(self.sched)


# Few distinct prompts sharing a head, so that the tiers hold what the small pool loses.
BASE = list(range(20, 36))
prompts = st.sampled_from(
    [BASE[:9], BASE[:12], BASE[:7] + [40, 41, 42, 43, 44], BASE[:4] + [50] * 6, [60, 61, 62]]
)
ops = st.one_of(
    st.tuples(st.just("add"), prompts, st.integers(1, 6)),
    st.tuples(st.just("add"), prompts, st.integers(1, 6)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seq=st.lists(ops, min_size=10, max_size=70),
    bs=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(4, 12),
    budget=st.integers(2, 24),
    max_seqs=st.integers(1, 4),
    max_len=st.integers(12, 24),
    host_slots=st.sampled_from([0, 0, 1, 3, 8]),
    disk_blocks=st.sampled_from([1, 4, 64]),
    fail_rate=st.sampled_from([0.0, 0.0, 0.2]),
    seed=st.integers(0, 1000),
)
def test_random_workloads_behind_tiers_read_their_own_prefix_and_drain(
    seq, bs, num_blocks, budget, max_seqs, max_len, host_slots, disk_blocks, fail_rate, seed
):
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_queue_len=8)
    d = TierDriver(cfg, num_blocks, bs, max_len, host_slots, disk_blocks, fail_rate, seed)
    for op in seq:
        if op[0] == "add":
            d.add(op[1], op[2])
        elif op[0] == "step":
            d.step()
        else:
            d.abort(op[1])
    for i in range(3000):
        if not (d.sched.has_unfinished_requests() or d.sched.has_kv_moves()):
            break
        d.step(everything=i > 1000)
    assert not d.sched.has_unfinished_requests() and not d.sched.has_kv_moves()
    assert all(r.is_finished for r in d.added)
    pool = d.sched.kv_manager.pool
    assert pool.num_free_blocks == num_blocks and pool.num_held_for_save == 0
    st_ = d.sched.kv_tier.stats()
    target(float(st_.hit_tokens[DISK_TIER]), label="disk hit tokens")
    target(float(st_.hit_tokens[HOST_TIER]), label="host hit tokens")
    target(float(st_.load_failures), label="failed loads")
