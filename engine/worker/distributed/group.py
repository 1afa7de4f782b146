"""Joining the tensor-parallel process group, and what each rank runs on.

The rendezvous is a TCPStore that rank 0 opens on a free loopback port before it starts the
workers (ranks live on one machine); every rank then joins torch.distributed's default
process group through it. `backend_for` is the only place CPU and CUDA differ: gloo on the
CPU, NCCL on CUDA. `timeout_s` bounds every collective: a rank that does not show up within
it makes the others raise instead of waiting forever.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.config import RuntimeConfig
from engine.worker.models.parallel import TensorParallel

HOST = "127.0.0.1"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU for every rank, or cuda:(index of rank 0's GPU + r)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def threads_per_rank(runtime: RuntimeConfig, size: int) -> int | None:
    """torch threads for each rank: runtime.num_threads (or the CPUs this process may use)
    shared out, at least one each, so the ranks do not oversubscribe the cores. At size 1,
    runtime.num_threads as it is (None: torch's default)."""
    if size == 1:
        return runtime.num_threads
    available = runtime.num_threads or _usable_cpus()
    return max(1, available // size)


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))  # what this process may run on (cgroups, taskset)
    return os.cpu_count() or 1


def open_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (`store.port` is what the workers dial)."""
    return dist.TCPStore(
        HOST, 0, size, is_master=True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip


def join_group(
    store: dist.Store | int, rank: int, size: int, device: torch.device, timeout_s: float
) -> TensorParallel:
    """Joins the default process group as `rank` (rank 0 passes its store, the workers the
    store's port) and returns the rank's `TensorParallel`."""
    if isinstance(store, int):
        store = dist.TCPStore(
            HOST, store, size, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process (another "
            "tensor-parallel engine still running?); close it first"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), store=store, rank=rank, world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    return TensorParallel(rank, size, device)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
