"""The KV tiers' decisions, torch-free: what to save on free, what to load, what to evict.

The pool's prefix cache keeps a block only until an allocation takes it. With a tier behind
it (pinned host memory on a GPU, files on a disk), `KVTierManager` keeps the block's KV
under the very same chained hash (`engine.core.kv_cache.hashing`: tokens, parent, extra keys
such as the cache salt and the LoRA adapter), so tenancy and adapters hold in the tiers
exactly as in the pool. Nothing else keys a block.

Saving (on free). When a cached block's last reference goes, the pool asks `_hold_for_save`:
if a tier lacks the block, the save is reserved in the tier's index (evicting LRU entries,
whose files are deleted), a `KVMove` is queued for the step's `SchedulerOutput.kv_saves`,
and the block stays out of the free queue (held) until the worker reports it copied, since
its next owner would otherwise overwrite it in the very step that evicts it. A hold lasts
one step: the worker's copy is a memcpy into a host slot or a staging buffer (it drops the
save rather than wait for a slow disk), and a running request that needs a block while some
are held waits that step instead of preempting another (`held_blocks_return`).
`max_held_blocks` bounds the holds all the same; past it a freed block is not saved.

Loading (the "loading" state). A waiting request whose pool prefix stops before its tier
prefix gets `try_load`: the pool prefix is pinned, new blocks are taken for the tier hits
and `KVMove`s queued for `kv_loads`. The request keeps its place in the waiting queue but is
skipped (`is_loading`) until every load is reported, so it never holds a step. A loaded
block is registered in the pool's cache under its hash, and once the last load is in the
pins go: the blocks are then ordinary cached free blocks at the free queue's tail (evicted
last), which the request's prefix lookup hits like any other, so two requests that loaded
at once can never hold each other's room. A failed or corrupt load registers nothing and
the request computes those tokens. `on_finished` (abort, deadline, error: the one hook for
every way out) releases the pins of a request still loading; a block the worker is still
writing is released when its load is reported. `on_admitted` counts what the tiers served.

Moves leave through `take_moves` (the scheduler's output) and results come back through
`apply` (the runner's output): the core never waits for the worker.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.kv_cache.block_pool import KVBlock
from engine.core.kv_cache.hashing import BlockHash
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.kv_tier.index import TierIndex
from engine.core.request import Request
from engine.core.step_io import DISK_TIER, HOST_TIER, KVMove, KVTierReport

logger = logging.getLogger(__name__)

# Seconds from issuing a request's loads to the last one reported (vLLM-style buckets).
LOAD_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

_PENDING, _OK, _FAILED = 0, 1, 2


@dataclass(frozen=True)
class TierSizes:
    """The tiers' capacities, fixed at start-up (0 turns a tier off)."""

    host_slots: int = 0  # blocks the host tier holds
    host_block_bytes: int = 0  # bytes of one block there
    disk_capacity_bytes: int = 0  # bytes of files the disk tier may hold
    disk_file_bytes: int = 0  # bytes of one block's file (header included)
    max_held_blocks: int = 0  # blocks held for saving at once; 0: the whole pool


@dataclass
class KVTierStats:
    """A snapshot for metrics; counters are cumulative since start. Dicts are by tier."""

    hit_tokens: dict[str, int]  # prompt tokens admitted from each tier
    query_tokens: int  # prompt tokens of admitted requests the pool lacked
    bytes_written: dict[str, int]
    bytes_read: dict[str, int]
    load_failures: int  # blocks whose load failed (missing, corrupt, unreadable)
    saves_skipped: int  # freed blocks not saved: too many held, no room, a failed store
    usage_bytes: dict[str, int]
    capacity_bytes: dict[str, int]
    blocks_held: int  # blocks held out of the free queue for saving, now
    requests_loading: int  # requests in the loading state, now
    # Load latency histogram: counts per LOAD_LATENCY_BUCKETS bound (non-cumulative, one
    # more for +Inf), their sum and count.
    load_latency_counts: list[int] = field(default_factory=list)
    load_latency_sum: float = 0.0
    load_latency_bounds: tuple[float, ...] = LOAD_LATENCY_BUCKETS
    disk_error: str | None = None


class _LoadJob:
    """One request's loads: the pool prefix it pinned and the blocks being filled."""

    __slots__ = ("request", "prefix", "targets", "hashes", "tiers", "state", "pending", "gone")

    def __init__(self, request: Request, prefix: list[KVBlock], start: int):
        self.request = request
        self.prefix = prefix  # pool blocks 0 .. start-1 of its prefix, pinned
        self.targets: list[KVBlock] = []  # blocks start .. being loaded
        self.hashes: list[BlockHash] = []
        self.tiers: list[str] = []
        self.state: list[int] = []
        self.pending = 0
        self.gone = False  # the request left while loads were in flight


class KVTierManager:
    """The tiers' indexes and every decision about them; installs itself as the pool's
    save hook. See the module docstring."""

    def __init__(
        self,
        kv: KVCacheManager,
        sizes: TierSizes,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not kv.enable_prefix_caching:
            raise ValueError("a KV tier needs prefix caching: its keys are the block hashes")
        self.kv = kv
        self.pool = kv.pool
        self.block_size = kv.block_size
        self.sizes = sizes
        self._clock = clock
        self.host: TierIndex | None = None
        self.disk: TierIndex | None = None
        if sizes.host_slots > 0:
            self.host = TierIndex(
                HOST_TIER, sizes.host_slots * sizes.host_block_bytes, sizes.host_slots
            )
        if sizes.disk_capacity_bytes > 0:
            self.disk = TierIndex(DISK_TIER, sizes.disk_capacity_bytes)
        self.max_held = sizes.max_held_blocks or kv.num_blocks
        self._saves: list[KVMove] = []
        self._loads: list[KVMove] = []
        self._deletes: list[BlockHash] = []
        self._held: dict[int, KVBlock] = {}  # block id -> block held for its save's copy
        # Reserved tier entries not reported stored or failed yet, by tier.
        self._writes = {HOST_TIER: 0, DISK_TIER: 0}
        self._host_for_disk: set[BlockHash] = set()  # host entries a disk write reads
        self._jobs: dict[str, _LoadJob] = {}  # request id -> its loads
        self._loading: dict[int, tuple[_LoadJob, int]] = {}  # block id -> (job, index)
        self._hit_tokens = {HOST_TIER: 0, DISK_TIER: 0}
        self._query_tokens = 0
        self._written = {HOST_TIER: 0, DISK_TIER: 0}
        self._read = {HOST_TIER: 0, DISK_TIER: 0}
        self._load_failures = 0
        self._saves_skipped = 0
        self._latency = [0] * (len(LOAD_LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self.disk_error: str | None = None
        self.pool.save_hook = self._hold_for_save

    # ---- queries ---------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    @property
    def busy(self) -> bool:
        """Moves not yet handed out or not yet reported: the engine keeps stepping until
        none are left (held blocks return to the pool, and the index learns what is stored,
        only in a step)."""
        return bool(
            self._saves or self._loads or self._deletes or self._held or self._loading
            or self._writes[HOST_TIER] or self._writes[DISK_TIER]
        )  # fmt: skip

    def held_blocks_return(self) -> bool:
        """Blocks are held for their copy now and come back to the free queue within a
        step or so: a running request short of a block had better wait than preempt."""
        return self.pool.num_held_for_save > 0

    def is_loading(self, request: Request) -> bool:
        """The request waits for its loads (the scheduler skips it, keeping its place)."""
        job = self._jobs.get(request.request_id)
        return job is not None and job.pending > 0

    def _index(self, tier: str) -> TierIndex | None:
        return self.host if tier == HOST_TIER else self.disk

    # ---- saving ----------------------------------------------------------------------------
    def _hold_for_save(self, block: KVBlock) -> bool:
        """The pool's save hook: True holds the freed block until its copy is reported."""
        h = block.block_hash
        assert h is not None
        host, disk = self.host, self.disk
        want_host = host is not None and h not in host
        want_disk = disk is not None and h not in disk
        if not (want_host or want_disk):
            return False
        if self.pool.num_held_for_save >= self.max_held:
            self._saves_skipped += 1
            return False
        return self._queue_save(block, want_host, want_disk)

    def _queue_save(self, block: KVBlock, want_host: bool, want_disk: bool) -> bool:
        h = block.block_hash
        assert h is not None
        slot, to_disk = -1, False
        if want_host and self.host is not None:
            if self.host.reserve(h, self.sizes.host_block_bytes) is not None:
                slot = self.host.slot_of(h)
                self._writes[HOST_TIER] += 1
        if want_disk and self.disk is not None:
            evicted = self.disk.reserve(h, self.sizes.disk_file_bytes)
            if evicted is not None:
                self._deletes.extend(evicted)
                to_disk = True
                self._writes[DISK_TIER] += 1
        if slot < 0 and not to_disk:
            self._saves_skipped += 1
            return False
        if slot >= 0 and to_disk and self.host is not None:
            self.host.pin(h)  # the disk write reads the host slot: keep it
            self._host_for_disk.add(h)
        self._saves.append(KVMove(h, block.block_id, slot, to_disk))
        self._held[block.block_id] = block
        return True

    def flush_pool(self) -> int:
        """Drain: queues a disk save of every cached free pool block the disk tier lacks,
        the most recently freed first (so a disk too small keeps the freshest), ignoring
        `max_held_blocks`. Returns how many were queued."""
        if self.disk is None:
            return 0
        queue = self.pool.free_queue
        candidates = [b for b in reversed(list(queue)) if b.block_hash is not None]
        n = 0
        for block in candidates:
            if block.block_hash in self.disk:
                continue
            queue.remove(block)
            if self._queue_save(block, want_host=False, want_disk=True):
                block.save_pending = True
                self.pool.num_held_for_save += 1
                n += 1
            else:
                queue.append(block)
        return n

    # ---- loading ---------------------------------------------------------------------------
    def try_load(self, request: Request) -> bool:
        """Starts loading the request's tier prefix past its pool prefix; True when it now
        waits in the loading state. False (nothing changed) when a tier holds no block
        right after the pool prefix, the request never uses tiers, it already loaded once,
        or the pool cannot hold the loads plus one block to compute in."""
        if not request.uses_kv_tier or request.request_id in self._jobs or not self.enabled:
            return False
        kv, pool, bs = self.kv, self.pool, self.block_size
        limit = (request.num_tokens - 1) // bs  # leave >= 1 token to compute
        ids, _ = kv.get_computed_blocks(request)
        start = len(ids)
        if start >= limit:
            return False
        hits: list[tuple[BlockHash, str]] = []
        for h in kv.block_hashes(request, limit)[start:]:
            if self.host is not None and self.host.has(h):
                hits.append((h, HOST_TIER))
            elif self.disk is not None and self.disk.has(h):
                hits.append((h, DISK_TIER))
            else:
                break
        if not hits:
            return False
        prefix = [pool.blocks[i] for i in ids]
        evictable = sum(1 for b in prefix if b.ref_cnt == 0 and not b.save_pending)
        room = pool.num_free_blocks - evictable - 1
        if room < 1:
            return False
        hits = hits[:room]
        pool.touch(prefix)  # before get_new_blocks, which could evict them
        job = _LoadJob(request, prefix, start)
        for (h, tier), block in zip(hits, pool.get_new_blocks(len(hits)), strict=True):
            index = self._index(tier)
            assert index is not None
            index.pin(h)
            index.touch(h)
            slot = index.slot_of(h) if tier == HOST_TIER else -1
            self._loading[block.block_id] = (job, len(job.targets))
            job.targets.append(block)
            job.hashes.append(h)
            job.tiers.append(tier)
            job.state.append(_PENDING)
            self._loads.append(KVMove(h, block.block_id, slot))
        job.pending = len(hits)
        self._jobs[request.request_id] = job
        request.times.kv_load_started = self._clock()
        return True

    def on_admitted(self, request: Request, num_computed: int) -> int:
        """The request got its slots with `num_computed` tokens from the pool's prefix
        cache: counts the tier's share (also on the request, at its first admission) and
        forgets its load. Returns the tokens that came from a tier."""
        job = self._jobs.pop(request.request_id, None)
        from_tier = {HOST_TIER: 0, DISK_TIER: 0}
        if job is not None:
            start = len(job.prefix)
            hit_blocks = num_computed // self.block_size
            for k, tier in enumerate(job.tiers):
                if start + k < hit_blocks and job.state[k] == _OK:
                    from_tier[tier] += self.block_size
        total = from_tier[HOST_TIER] + from_tier[DISK_TIER]
        self._query_tokens += request.num_tokens - (num_computed - total)
        for tier, n in from_tier.items():
            self._hit_tokens[tier] += n
        if request.times.first_scheduled is None:
            request.tier_cached_tokens = from_tier
        return total

    def on_finished(self, request: Request) -> None:
        """The request left in any state (finished, aborted, deadline, error): its pins go.
        Blocks still being filled by the worker are released when their load is reported."""
        job = self._jobs.pop(request.request_id, None)
        if job is None or job.pending == 0:  # none, or its pins went with its last load
            return
        job.gone = True
        done = [b for k, b in enumerate(job.targets) if job.state[k] != _PENDING]
        self.pool.free_blocks(reversed(job.prefix + done))

    # ---- the step's messages ---------------------------------------------------------------
    def take_moves(self) -> tuple[list[KVMove], list[KVMove], list[BlockHash]]:
        """The saves, loads and disk deletes decided since the last call; clears them."""
        out = (self._saves, self._loads, self._deletes)
        self._saves, self._loads, self._deletes = [], [], []
        return out

    def apply(self, report: KVTierReport) -> None:
        """Takes in what the worker finished (see `KVTierReport`)."""
        pool = self.pool
        for block_id in report.copied:
            block = self._held.pop(block_id, None)
            if block is not None:
                pool.release_saved(block)
        for h, tier in report.stored:
            self._stored(h, tier, ok=True)
        for h, tier in report.store_failed:
            self._stored(h, tier, ok=False)
        for block_id in report.loaded:
            self._loaded(block_id, None)
        for block_id, why in report.load_failed:
            self._loaded(block_id, why)
        if report.scan_added or report.scan_removed:
            self._merge_scan(report.scan_added, report.scan_removed)
        if self.disk is not None:  # after store_failed dropped them from the index
            self._deletes.extend(h for h in report.orphaned if h not in self.disk)
        if report.disk_error is not None:
            self._disable_disk(report.disk_error)

    def _stored(self, h: BlockHash, tier: str, ok: bool) -> None:
        index = self._index(tier)
        if index is None:  # the disk tier was switched off meanwhile
            return
        self._writes[tier] = max(0, self._writes[tier] - 1)
        if ok and index.confirm(h):
            self._written[tier] += self._entry_bytes(tier)
        elif not ok:
            index.drop(h)
            self._saves_skipped += 1
        if tier == DISK_TIER and h in self._host_for_disk and self.host is not None:
            self._host_for_disk.discard(h)
            self.host.unpin(h)

    def _loaded(self, block_id: int, failure: str | None) -> None:
        entry = self._loading.pop(block_id, None)
        if entry is None:
            return
        job, k = entry
        h, tier, block = job.hashes[k], job.tiers[k], job.targets[k]
        index = self._index(tier)
        if failure is None:
            job.state[k] = _OK
            self.pool.cache_full_block(block, h)  # False: computed meanwhile; still fine
            self._read[tier] += self._entry_bytes(tier)
            if index is not None:
                index.unpin(h)
        else:
            job.state[k] = _FAILED
            self._load_failures += 1
            if index is not None:
                index.unpin(h)
                index.drop(h)  # never tried again: its request computes it
            logger.warning(
                "kv tier load failed, computing instead tier=%s block=%s reason=%s",
                tier, h.hex()[:16], failure,
            )  # fmt: skip
        job.pending -= 1
        if job.gone:
            self.pool.free_blocks((block,))
        elif job.pending == 0:
            now = self._clock()
            job.request.times.kv_load_finished = now
            started = job.request.times.kv_load_started or now
            self._observe_latency(now - started)
            # The pins go: cached free blocks now, the newest at the free queue's tail.
            self.pool.free_blocks(reversed(job.prefix + job.targets))

    def _merge_scan(self, added: list[tuple[bytes, int, float]], removed: list[bytes]) -> None:
        """Files another replica wrote or deleted (a shared directory): the index follows,
        then evicts the oldest idle entries if the directory went over its capacity."""
        disk = self.disk
        if disk is None:
            return
        for h in removed:
            if disk.has(h):
                disk.drop(h)
        for h, nbytes, _mtime in sorted(added, key=lambda a: a[2]):
            if h not in disk:
                disk.add_present(h, nbytes, over_capacity=True)
        self._deletes.extend(disk.evict_over_capacity())

    def load_index(self, entries: list[tuple[bytes, int, float]]) -> int:
        """Start-up: the disk tier's files as listed (hash, bytes, mtime), no block read.
        The most recent are kept when they exceed the capacity (the rest are deleted).
        Returns how many entries the index took."""
        disk = self.disk
        if disk is None:
            return 0
        n = 0
        for h, nbytes, _mtime in sorted(entries, key=lambda e: e[2], reverse=True):
            if disk.add_present(h, nbytes, lru_first=True):
                n += 1
            elif h not in disk:
                self._deletes.append(h)
        return n

    def _disable_disk(self, reason: str) -> None:
        if self.disk is None:
            return
        logger.error("kv disk tier off for the rest of this run: %s", reason)
        self.disk_error = reason
        self.disk.clear()
        self.disk = None
        self._deletes = []
        if self.host is not None:
            for h in self._host_for_disk:
                self.host.unpin(h)
        self._host_for_disk.clear()
        # Held saves still get their `copied`; the disk writes a worker whose disk is off
        # still reports are ignored (`_stored` sees no index).
        self._writes[DISK_TIER] = 0

    # ---- metrics ---------------------------------------------------------------------------
    def _entry_bytes(self, tier: str) -> int:
        s = self.sizes
        return s.host_block_bytes if tier == HOST_TIER else s.disk_file_bytes

    def _observe_latency(self, seconds: float) -> None:
        self._latency[bisect.bisect_left(LOAD_LATENCY_BUCKETS, seconds)] += 1
        self._latency_sum += seconds

    def stats(self) -> KVTierStats:
        usage, capacity = {}, {}
        for tier, index in ((HOST_TIER, self.host), (DISK_TIER, self.disk)):
            if index is not None:
                usage[tier], capacity[tier] = index.used_bytes, index.capacity_bytes
        return KVTierStats(
            hit_tokens=dict(self._hit_tokens),
            query_tokens=self._query_tokens,
            bytes_written=dict(self._written),
            bytes_read=dict(self._read),
            load_failures=self._load_failures,
            saves_skipped=self._saves_skipped,
            usage_bytes=usage,
            capacity_bytes=capacity,
            blocks_held=self.pool.num_held_for_save,
            requests_loading=sum(1 for j in self._jobs.values() if j.pending),
            load_latency_counts=list(self._latency),
            load_latency_sum=self._latency_sum,
            disk_error=self.disk_error,
        )
