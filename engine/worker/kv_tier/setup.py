"""Start-up of the KV tiers: sizes from the config, the disk directory's checks, the index.

`plan_kv_tiers` turns `cache.host_tier_gib` / `cache.disk_tier_*` into block counts and
refuses, naming the key, what cannot work (a tier smaller than one block, a directory that
is not writable or has no atomic rename). `start_kv_tiers` builds the core's
`KVTierManager` over the KV manager and the worker's `KVTierWorker` over the runner's
caches, rebuilds the disk index from the directory listing (no block is read) and logs
which other fingerprints it ignores.

The CPU decision for `cache.host_tier_gib` (docs/kv_tiers.md has the measurements): on the
CPU the pool is host memory already, so a host tier would hold the same bytes in the same
memory and only add a copy each way; compressing KV losslessly saves too little to pay for
itself (float KV does not compress). So on the CPU the host tier's GiB are added to the
pool, where a hit costs nothing at all. On CUDA they are pinned host memory behind the pool.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import CacheConfig, ConfigError, EngineConfig
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.kv_tier.manager import KVTierManager, TierSizes
from engine.worker.kv_tier.block_copier import BlockCopier
from engine.worker.kv_tier.block_file import file_bytes
from engine.worker.kv_tier.disk_store import DiskStore, DiskTierUnusable
from engine.worker.kv_tier.fingerprint import (
    fingerprint_digest,
    fingerprint_fields,
    weights_identity,
)
from engine.worker.kv_tier.host_buffers import HostTierSlots
from engine.worker.kv_tier.rank_reports import RankReportMerger
from engine.worker.kv_tier.tier_worker import KVTierWorker
from engine.worker.kv_tier.tp_tier_worker import ShardedTierWorker

logger = logging.getLogger(__name__)

_GIB = 1 << 30


@dataclass(frozen=True)
class TierPlan:
    """What the config asks of the tiers, in blocks of this model."""

    block_bytes: int  # one block's KV, every layer (a host slot, a file's payload)
    extra_pool_blocks: int = 0  # CPU: host_tier_gib folded into the pool
    host_slots: int = 0
    disk_dir: str | None = None
    disk_capacity_bytes: int = 0

    @property
    def enabled(self) -> bool:
        return self.host_slots > 0 or self.disk_dir is not None


def plan_kv_tiers(
    cache: CacheConfig, block_bytes: int, device: torch.device, tp_size: int = 1
) -> TierPlan:
    """The tiers' sizes; `ConfigError` naming the key for a tier below one block.

    Under tensor parallelism `block_bytes` is one rank's share of a block and the configured
    GiB are the whole tier's: each rank gets 1/tp_size of them, so a block counts the same
    as with one rank and the directory (every rank's subdirectory) stays within its bytes."""
    host_bytes = int(cache.host_tier_gib * _GIB) // tp_size
    host_blocks = host_bytes // block_bytes
    if cache.host_tier_gib > 0 and host_blocks < 1:
        raise ConfigError(
            "cache.host_tier_gib",
            f"{cache.host_tier_gib} GiB holds no KV block ({block_bytes * tp_size} bytes each)",
        )
    disk_bytes = 0
    if cache.disk_tier_dir is not None:
        disk_bytes = int(cache.disk_tier_gib * _GIB) // tp_size
        if disk_bytes < file_bytes(block_bytes):
            raise ConfigError(
                "cache.disk_tier_gib",
                f"{cache.disk_tier_gib} GiB holds no KV block file "
                f"({file_bytes(block_bytes) * tp_size} bytes each, over {tp_size} rank(s))",
            )
    if device.type != "cuda":
        return TierPlan(block_bytes, host_blocks, 0, cache.disk_tier_dir, disk_bytes)
    return TierPlan(block_bytes, 0, host_blocks, cache.disk_tier_dir, disk_bytes)


def open_disk_store(
    config: EngineConfig,
    plan: TierPlan,
    model_dir: Path,
    run_dtype: torch.dtype,
    geometry: tuple[int, int, int],
    tp_rank: int = 0,
) -> DiskStore:
    """The fingerprint directory, created, cleaned and probed; `ConfigError` naming
    cache.disk_tier_dir when it cannot hold the tier."""
    assert plan.disk_dir is not None
    num_layers, num_kv_heads, head_dim = geometry
    dtype = str(run_dtype).removeprefix("torch.")
    fields = fingerprint_fields(
        weights=weights_identity(model_dir), model_config=config.model, run_dtype=dtype,
        kv_dtype=dtype if config.cache.kv_dtype == "auto" else config.cache.kv_dtype,
        block_size=config.cache.block_size, num_layers=num_layers,
        num_kv_heads=num_kv_heads, head_dim=head_dim,
        tp_size=config.parallel.tensor_parallel_size, tp_rank=tp_rank,
    )  # fmt: skip
    store = DiskStore(
        plan.disk_dir,
        fingerprint_digest(fields),
        fields,
        plan.block_bytes,
        direct_io=config.cache.disk_tier_direct_io,
    )
    try:
        store.open()
    except DiskTierUnusable as e:
        raise ConfigError("cache.disk_tier_dir", f"cannot hold the KV disk tier: {e}") from e
    return store


def start_kv_tiers(
    plan: TierPlan,
    kv: KVCacheManager,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    disk: DiskStore | None,
    rescan_s: float | None,
    ranks: RankTiers | None = None,
) -> tuple[KVTierManager, KVTierWorker | ShardedTierWorker]:
    """The core's manager and the worker's threads, the disk index rebuilt from its listing.
    `ranks`: under tensor parallelism, the worker ranks' listings and report pipes; the
    index then takes the blocks whose files every rank holds."""
    copier = BlockCopier(kv_caches, device)
    host = _host_slots(plan, copier)
    sizes = TierSizes(
        host_slots=plan.host_slots,
        host_block_bytes=plan.block_bytes,
        disk_capacity_bytes=plan.disk_capacity_bytes if disk is not None else 0,
        disk_file_bytes=file_bytes(plan.block_bytes),
    )
    manager = KVTierManager(kv, sizes)
    merger = RankReportMerger(1 + len(ranks.listings)) if ranks is not None else None
    known: set[bytes] = set()
    if disk is not None:
        t0 = time.perf_counter()
        listing = [(e.block_hash, e.nbytes, e.mtime) for e in disk.scan()]
        known = {h for h, _, _ in listing}
        if merger is not None:
            # the blocks every rank holds; the others go to the core as `orphaned`
            listing = merger.seed_listings([listing, *ranks.listings])
        taken = manager.load_index(listing)
        others = disk.other_fingerprints()
        logger.info(
            "kv disk tier ready dir=%s files=%d indexed=%d capacity_gib=%.2f index_s=%.3f",
            disk.dir, len(known), taken, plan.disk_capacity_bytes / _GIB,
            time.perf_counter() - t0,
        )  # fmt: skip
        if others:
            logger.info(
                "kv disk tier ignores %d other fingerprint directories under %s (another "
                "model or settings: %s)",
                len(others), disk.root,
                "; ".join(f"{d} differs in {','.join(k)}" for d, k in sorted(others.items())),
            )  # fmt: skip
    worker = KVTierWorker(copier, host, disk, rescan_s=rescan_s, known_files=known)
    if ranks is None:
        return manager, worker
    return manager, ShardedTierWorker(worker, ranks.conns, merger)


@dataclass
class RankTiers:
    """What rank 0 needs of the worker ranks' tiers: each one's disk listing (empty without
    a disk tier) and the pipe its reports arrive on, rank 1 first."""

    listings: list[list[tuple[bytes, int, float]]]
    conns: list


def start_rank_tier(
    config: EngineConfig,
    plan: TierPlan,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    model_dir: Path,
    run_dtype: torch.dtype,
    geometry: tuple[int, int, int],
    rank: int,
) -> tuple[KVTierWorker | None, list[tuple[bytes, int, float]]]:
    """A tensor-parallel worker rank's tier over its share of the blocks, and its disk
    listing for rank 0's index (None and [] when the tiers are off). `plan`: this rank's
    `plan_kv_tiers`, the one its pool was sized with."""
    if not plan.enabled:
        return None, []
    disk = None
    listing: list[tuple[bytes, int, float]] = []
    if plan.disk_dir is not None:
        disk = open_disk_store(config, plan, model_dir, run_dtype, geometry, tp_rank=rank)
        listing = [(e.block_hash, e.nbytes, e.mtime) for e in disk.scan()]
    copier = BlockCopier(kv_caches, device)
    worker = KVTierWorker(
        copier, _host_slots(plan, copier), disk, rescan_s=config.cache.disk_tier_rescan_s,
        known_files={h for h, _, _ in listing},
    )  # fmt: skip
    return worker, listing


def _host_slots(plan: TierPlan, copier: BlockCopier) -> HostTierSlots | None:
    if not plan.host_slots:
        return None
    return HostTierSlots(plan.host_slots, copier.block_shape, copier.dtype, copier.cuda)
