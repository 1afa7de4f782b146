"""A stand-in for the worker's side of the KV tiers, for the torch-free core tests (no tests).

`FakeTierWorker` carries out a `SchedulerOutput`'s tier moves on dictionaries: a save's copy
is reported at once (`copied`), and stores and loads are reported on the step they were
submitted unless the test holds them (`hold_loads`, `hold_stores`), so a test decides
exactly when the core hears of them. `contents` maps a pool block id to the hash whose KV it
holds, as a runner's KV cache would: a load writes it, a prefill writes it (see
`write_computed`), so a test can check that every block a request reads holds its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.kv_tier.manager import KVTierManager, TierSizes
from engine.core.scheduler import Scheduler
from engine.core.step_io import DISK_TIER, HOST_TIER, KVTierReport, SchedulerOutput
from tests.support.scheduler_helpers import fake_runner_output

FILE_BYTES = 100  # one block's file in these tests


@dataclass
class FakeTierWorker:
    host: dict[int, bytes] = field(default_factory=dict)  # slot -> hash
    disk: set[bytes] = field(default_factory=set)
    hold_loads: bool = False
    hold_stores: bool = False
    hold_copies: bool = False
    fail_loads: set[bytes] = field(default_factory=set)  # hashes whose loads fail (corrupt)
    pending: KVTierReport = field(default_factory=KVTierReport)
    held_loads: list = field(default_factory=list)
    held_copies: list[int] = field(default_factory=list)
    held_stores: list = field(default_factory=list)
    submitted_saves: list = field(default_factory=list)
    submitted_loads: list = field(default_factory=list)
    deleted: list[bytes] = field(default_factory=list)

    def submit(self, so: SchedulerOutput) -> None:
        for h in so.kv_deletes:
            self.disk.discard(h)
            self.deleted.append(h)
        for m in so.kv_saves:
            self.submitted_saves.append(m)
            (self.held_copies if self.hold_copies else self.pending.copied).append(m.block_id)
            stores = []
            if m.host_slot >= 0:
                self.host[m.host_slot] = m.block_hash
                stores.append((m.block_hash, HOST_TIER))
            if m.to_disk:
                stores.append((m.block_hash, DISK_TIER))
            for st in stores:
                (self.held_stores if self.hold_stores else self.pending.stored).append(st)
        for m in so.kv_loads:
            self.submitted_loads.append(m)
            if self.hold_loads:
                self.held_loads.append(m)
            else:
                self.finish_load(m)

    def finish_load(self, m) -> None:
        if m.block_hash in self.fail_loads:
            self.pending.load_failed.append((m.block_id, "checksum mismatch"))
        else:
            self.pending.loaded.append(m.block_id)

    def release(self) -> None:
        """Reports everything held so far in the next report."""
        self.pending.copied += self.held_copies
        self.held_copies = []
        for m in self.held_loads:
            self.finish_load(m)
        self.held_loads = []
        for st in self.held_stores:
            if st[1] == DISK_TIER:
                self.disk.add(st[0])
            self.pending.stored.append(st)
        self.held_stores = []

    def report(self) -> KVTierReport | None:
        for h, tier in self.pending.stored:
            if tier == DISK_TIER:
                self.disk.add(h)
        out, self.pending = self.pending, KVTierReport()
        return out if out else None


def tier_scheduler(
    num_blocks: int = 8,
    disk_blocks: int = 64,
    host_slots: int = 0,
    block_size: int = 4,
    max_held_blocks: int = 0,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
) -> Scheduler:
    """A scheduler over a real KV manager with a KVTierManager of `disk_blocks` files
    (0: no disk tier) and `host_slots` host blocks (0: no host tier)."""
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens)
    kv = KVCacheManager(num_blocks, block_size)
    sizes = TierSizes(
        host_slots=host_slots,
        host_block_bytes=FILE_BYTES,
        disk_capacity_bytes=disk_blocks * FILE_BYTES,
        disk_file_bytes=FILE_BYTES,
        max_held_blocks=max_held_blocks,
    )
    return Scheduler(cfg, kv, max_model_len, kv_tier=KVTierManager(kv, sizes))


def tier_step(sched: Scheduler, worker: FakeTierWorker, token: int | dict[str, int] = 7):
    """One step with the fake tier worker: schedule, submit the moves, sample, report."""
    so = sched.schedule()
    worker.submit(so)
    out = fake_runner_output(sched, so, token)
    out.kv_tier = worker.report()
    return so, sched.update_from_output(so, out)


def run_until_idle(sched: Scheduler, worker: FakeTierWorker, max_steps: int = 500) -> int:
    """Steps until no request and no tier move is left; returns the steps taken."""
    for n in range(max_steps):
        if not (sched.has_unfinished_requests() or sched.has_kv_moves()):
            return n
        tier_step(sched, worker)
    raise AssertionError(f"not idle after {max_steps} steps")
