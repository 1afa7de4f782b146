"""A tensor-parallel worker process (ranks 1..size-1): the target rank 0 spawns.

    hello -> join the group -> load its shard -> loaded -> size the KV cache (the minimum
    over the ranks) -> ready
    then: receive a step, append what rank 0 sampled last step, run the step; until STOP

The worker never samples and never decides anything: it computes its shard of the step
rank 0 sends, in the same order of collectives, and so its state follows rank 0's.

It never outlives rank 0: it ignores SIGINT and SIGTERM (a Ctrl-C or a SIGTERM sent to the
whole process group must not cut a rank out from under rank 0's drain; rank 0 stops it),
exits when rank 0's process ends (a thread waits on multiprocessing's parent sentinel), and
exits on any error after reporting it over the pipe. Steps arrive through the shared-memory
ring of `transport.py`; the pipe carries start-up messages and errors back to rank 0.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch

from engine.config import EngineConfig
from engine.worker.attention.kv_dtype import kv_cache_dtype
from engine.worker.distributed.group import join_group, leave_group
from engine.worker.distributed.transport import STOP, RingHandle, StepReader, decode_step
from engine.worker.host_malloc import keep_freed_memory
from engine.worker.kv_sizing import KVGeometry, size_kv_cache
from engine.worker.kv_tier.setup import plan_kv_tiers, start_rank_tier
from engine.worker.kv_tier.tier_worker import KVTierWorker
from engine.worker.kv_tier.tp_tier_worker import tier_report_sender
from engine.worker.models.loader import load_model, resolve_max_model_len
from engine.worker.pooling.spec import embedding_max_len
from engine.worker.runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    config: EngineConfig  # model.path already resolved to a local HF directory by rank 0
    rank: int
    device: str  # this rank's device, e.g. "cpu" or "cuda:1"
    store_port: int  # rank 0's rendezvous TCPStore on the loopback
    num_threads: int | None


def worker_main(
    spec: WorkerSpec, ring: RingHandle, conn: Connection, tier_conn: Connection
) -> None:
    """Process entry point. Messages to rank 0: ("hello",), ("loaded",), ("ready",
    num_blocks, its KV disk tier's listing), or ("error", traceback text) before it exits.
    `tier_conn` carries its KV tier's reports (engine/worker/kv_tier/tp_tier_worker.py)."""
    _quiet_progress_bars()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    try:
        runner, tier = _start(spec, conn)
        if tier is not None:
            tier_report_sender(tier, tier_conn)
        _run_steps(runner, tier, StepReader(ring, conn))
    except BaseException:
        text = traceback.format_exc()
        logger.error("tensor-parallel rank %d failed:\n%s", spec.rank, text)
        try:
            conn.send(("error", text))
        except OSError:
            pass
        os._exit(1)  # no clean-up that could wait on peers that are gone
    leave_group()


def _quiet_progress_bars() -> None:
    """tqdm takes a thread lock here instead of its default multiprocessing one, which a
    killed worker would leak (the resource tracker then warns at rank 0's exit). The bars
    themselves are off (`load_model(progress=False)`): rank 0 shows the load's progress."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def _start(spec: WorkerSpec, conn: Connection) -> tuple[ModelRunner, KVTierWorker | None]:
    config = spec.config
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    torch.manual_seed(config.model.seed)
    device = torch.device(spec.device)
    size = config.parallel.tensor_parallel_size
    conn.send(("hello",))
    tp = join_group(spec.store_port, spec.rank, size, device, config.parallel.timeout_s)
    loaded = load_model(config.model, device, tp, progress=False)
    conn.send(("loaded",))
    block_size = config.cache.block_size
    kv_dtype = kv_cache_dtype(config.cache.kv_dtype, loaded.dtype)
    runner = ModelRunner(
        loaded.model, device, loaded.dtype, block_size, config.runtime, pooling=loaded.pooling,
        kv_dtype=kv_dtype,
    )  # fmt: skip
    max_model_len = embedding_max_len(
        config.model, resolve_max_model_len(config.model, loaded.hf_config), loaded.pooling
    )
    geom = KVGeometry.of(loaded.model, block_size, kv_dtype)
    num_blocks = size_kv_cache(runner, config, geom, max_model_len, tp)
    plan = plan_kv_tiers(config.cache, geom.bytes_per_block, device, size)
    num_blocks += plan.extra_pool_blocks  # as rank 0 does (the CPU's host_tier_gib)
    runner.allocate_kv_cache(num_blocks)
    if device.type == "cpu":  # as rank 0 does once loaded
        keep_freed_memory(config.runtime.malloc_keep_mib)
    tier, listing = start_rank_tier(
        config, plan, runner.kv_caches, device, loaded.model_dir, loaded.dtype,
        (geom.num_layers, geom.num_kv_heads, geom.head_dim), spec.rank,
    )  # fmt: skip
    conn.send(("ready", num_blocks, listing))
    return runner, tier


def _run_steps(runner: ModelRunner, tier: KVTierWorker | None, steps: StepReader) -> None:
    """Runs the steps rank 0 sends until told to stop; the step's KV tier moves are handed
    to this rank's tier first, as rank 0 does with its own."""
    while True:
        data = steps.recv()
        if data == STOP:
            steps.close()
            if tier is not None:
                tier.close()
            return
        msg = decode_step(data)
        if tier is not None:
            tier.submit(msg.so.kv_saves, msg.so.kv_loads, msg.so.kv_deletes)
        runner.append_sampled(msg.sampled_req_ids, msg.sampled_token_ids)
        runner.execute(msg.so)
