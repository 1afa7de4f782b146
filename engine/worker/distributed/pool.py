"""Rank 0's side of tensor parallelism: start the workers, send them each step, watch them.

`WorkerPool.start` checks the config (before any process exists), spawns ranks 1..size-1,
waits until each has started (or died), and joins the process group as rank 0. The engine
then loads rank 0's shard and sizes its cache while the workers do the same; `await_ready`
waits for them. `run_step` sends a step to every worker and runs rank 0's part of it.

Faults are turned into one fatal `WorkerFailedError` naming the rank and what happened,
never a hang:

- a worker that dies is seen at once by a watcher thread waiting on the processes'
  sentinels (also between steps, so health turns red while idle); it records the reason and
  kills the other workers, so whatever rank 0 is blocked in (a gloo collective, a full
  step ring) fails at once; the step then raises the recorded reason;
- a worker that hangs: every collective gives up after `parallel.timeout_s` (the process
  group's timeout), and the watcher also ends a step that has run longer than that;
- rank 0's own step raising after the workers got the step leaves them waiting in a
  collective rank 0 will not join: the same fatal error, with rank 0's exception as cause.

Once fatal, every later step raises the same error; the pool must be closed. `close` (also
registered with atexit, ahead of multiprocessing's own exit handler) stops the workers with
a STOP message, then kills what has not exited.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.core.step_io import RunnerOutput, SchedulerOutput
from engine.errors import WorkerFailedError
from engine.worker.distributed.checks import check_tensor_parallel
from engine.worker.distributed.group import (
    join_group,
    leave_group,
    open_store,
    rank_device,
    threads_per_rank,
)
from engine.worker.distributed.transport import STOP, StepWriter, encode_step
from engine.worker.distributed.worker import WorkerSpec, worker_main
from engine.worker.models.loader import resolve_model_path
from engine.worker.models.parallel import TensorParallel

logger = logging.getLogger(__name__)

# How long close() waits for the workers to leave after STOP before killing them.
STOP_GRACE_S = 10.0
# After a failed step: how long to wait for a worker's death to become visible (its sockets
# close a moment before the process can be reaped) before blaming rank 0 itself.
DEATH_GRACE_S = 1.0


# A worker that dies before its first message never ran our code: usually the main module
# cannot be re-imported under spawn.
_SPAWN_HINT = (
    " before starting (its error is on stderr; a script that creates a tensor-parallel engine "
    'needs an `if __name__ == "__main__":` guard, as any multiprocessing spawn does)'
)


class WorkerStartError(RuntimeError):
    """A worker failed while starting; the message carries its error."""


class WorkerPool:
    """Rank 0's handle on the worker processes; see the module docstring."""

    def __init__(self, size: int, timeout_s: float):
        self.size = size
        self.timeout_s = timeout_s
        self.tp = TensorParallel()  # rank 0's, set once the group is joined
        self.fatal: str | None = None  # why no step can run any more
        self._procs: list[Any] = []  # multiprocessing Process, rank r at index r - 1
        self._conns: list[Connection] = []
        # Each worker's KV tier reports, and its disk tier's listing at start (rank 1 first).
        self.tier_conns: list[Connection] = []
        self.tier_listings: list[list[tuple[bytes, int, float]]] = []
        self._rings: list[StepWriter] = []  # each worker's step messages
        self._store: Any = None
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()  # one reader of a worker's pipe at a time
        # One thread at a time waits for / reaps the processes: two threads reaping the same
        # child race, and the loser sees no exit status at all.
        self._proc_lock = threading.RLock()
        self._closing = False
        self._step_started: float | None = None  # monotonic start of the step in flight
        # Rank 0's last sampled tokens: request ids and each one's new tokens.
        self._sampled: tuple[list[str], list[list[int]]] = ([], [])

    # ---- start-up -------------------------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> WorkerPool:
        """Checks the config, starts the workers and joins the group as rank 0 on `device`."""
        from transformers import AutoConfig

        size = config.parallel.tensor_parallel_size
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group already exists in this process (another "
                "tensor-parallel engine still open?); close it first"
            )
        model_dir = resolve_model_path(config.model.path)  # GGUF converted once, here
        hf_config = AutoConfig.from_pretrained(str(model_dir))
        count = torch.cuda.device_count() if device.type == "cuda" else 0
        check_tensor_parallel(config, hf_config, device.type, device.index or 0, count)
        pool = cls(size, config.parallel.timeout_s)
        try:
            pool._spawn(replace(config, model=replace(config.model, path=str(model_dir))), device)
            pool._await("hello")
            pool.tp = join_group(pool._store, 0, size, rank_device(device, 0), pool.timeout_s)
        except BaseException:
            pool.close()
            raise
        return pool

    def _spawn(self, config: EngineConfig, device: torch.device) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._store = open_store(self.size, self.timeout_s)
        threads = threads_per_rank(config.runtime, self.size)
        atexit.register(self.close)
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe(duplex=True)
            tier_in, tier_out = ctx.Pipe(duplex=False)  # its KV tier's reports
            ring = StepWriter(ctx, ours)
            self._rings.append(ring)
            spec = WorkerSpec(
                config, rank, str(rank_device(device, rank)), self._store.port, threads
            )
            proc = ctx.Process(
                target=worker_main, args=(spec, ring.handle, theirs, tier_out),
                name=f"tp-rank{rank}", daemon=True,
            )  # fmt: skip
            proc.start()
            theirs.close()
            tier_out.close()
            self._procs.append(proc)
            self._conns.append(ours)
            self.tier_conns.append(tier_in)
        logger.info(
            "tensor-parallel workers started",
            extra={"fields": {"size": self.size, "pids": self.pids, "threads_per_rank": threads}},
        )

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, rank 1 first."""
        return [p.pid for p in self._procs]

    def await_loaded(self) -> None:
        """Waits until every worker has loaded its shard: the start-up collectives that
        follow (KV sizing) must not time out on a worker that is still loading."""
        self._await("loaded")

    def await_ready(self, num_blocks: int) -> None:
        """Waits until every worker has its shard and KV cache; each must have sized the
        same `num_blocks` as rank 0 (they agreed on the minimum)."""
        for rank, msg in self._await("ready"):
            if msg[1] != num_blocks:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} sized {msg[1]} KV blocks, rank 0 {num_blocks}"
                )
            self.tier_listings.append(msg[2])
        # From here on a death is watched for between and during steps. (While starting,
        # `_await` waits on the sentinels itself, and a collective with a dead peer fails.)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _await(self, kind: str) -> list[tuple[int, tuple]]:
        """The next message of each worker, which must be `kind`; raises WorkerStartError
        when a worker reports an error or dies first (never waits on a dead worker)."""
        got = []
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), 1):
            wait([conn, proc.sentinel])
            msg = self._message(conn)
            if msg is None:
                proc.join()  # its sentinel fired: it has exited
                hint = _SPAWN_HINT if kind == "hello" else ""
                raise WorkerStartError(f"tensor-parallel rank {rank} {_exit_text(proc)}{hint}")
            if msg[0] == "error":
                raise WorkerStartError(
                    f"tensor-parallel rank {rank} failed to start: {_last_line(msg[1])}"
                )
            got.append((rank, msg))
        return got

    def _message(self, conn: Connection) -> tuple | None:
        """The worker's next message if one is waiting (one reader at a time)."""
        with self._read_lock:
            try:
                return conn.recv() if conn.poll() else None
            except (EOFError, OSError):
                return None

    def explain_start_failure(self, exc: BaseException) -> BaseException:
        """What to raise when rank 0's start-up failed while the workers were starting: the
        workers that died and their errors (a worker that died loading breaks rank 0's
        collective), else `exc` itself."""
        wait([p.sentinel for p in self._procs], timeout=DEATH_GRACE_S)
        dead = self._deaths()
        if not dead:
            return exc
        return WorkerStartError(
            f"tensor-parallel start-up failed: {dead} (rank 0: {type(exc).__name__}: {exc})"
        )

    # ---- steps ----------------------------------------------------------------------------
    def run_step(
        self, execute: Callable[[SchedulerOutput], RunnerOutput], so: SchedulerOutput
    ) -> RunnerOutput:
        """Sends `so` (and rank 0's previous samples) to every worker, then runs rank 0's
        part with `execute` (the runner's). Raises WorkerFailedError when the group broke."""
        if self.fatal is not None:
            raise WorkerFailedError(self._failure_text())
        data = encode_step(so, *self._sampled)
        self._step_started = time.monotonic()
        try:
            for ring in self._rings:
                ring.send(data, self.timeout_s, abandon=lambda: self.fatal is not None)
            self._sampled = ([], [])
            out = execute(so)
        except Exception as e:
            raise self._failed_step(e) from e
        finally:
            self._step_started = None
        self._sampled = (out.req_ids, out.sampled_token_ids)
        return out

    def _failed_step(self, exc: Exception) -> WorkerFailedError:
        if self.fatal is None:
            wait([p.sentinel for p in self._procs], timeout=DEATH_GRACE_S)
            dead = self._deaths()
            self._set_fatal(
                dead
                or f"rank 0's step failed ({type(exc).__name__}: {exc}), which leaves the "
                "workers out of step"
            )
        return WorkerFailedError(self._failure_text())

    def _failure_text(self) -> str:
        return f"tensor-parallel engine failed: {self.fatal}; it cannot run another step"

    # ---- watching -------------------------------------------------------------------------
    def _watch(self) -> None:
        """Waits on the workers' sentinels; records the first death, or a step running past
        `timeout_s`, as fatal. Ends when the pool closes or goes fatal."""
        sentinels = [p.sentinel for p in self._procs]
        poll_s = min(1.0, self.timeout_s / 4)
        while not self._closing and self.fatal is None:
            if wait(sentinels, timeout=poll_s):
                if not self._closing:
                    self._set_fatal(self._deaths() or "a worker exited")
                return
            started = self._step_started
            if started is not None and time.monotonic() - started > self.timeout_s:
                self._set_fatal(
                    f"a step waited more than parallel.timeout_s={self.timeout_s:g}s for the "
                    "workers (a worker is hung)"
                )
                return

    def _deaths(self) -> str:
        """'rank r (pid p) was killed by SIGKILL: <its error>; ...' for the dead workers."""
        parts = []
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), 1):
            if not wait([proc.sentinel], timeout=0):
                continue
            with self._proc_lock:  # its sentinel closes a moment before it can be reaped
                proc.join(DEATH_GRACE_S)
            text = f"rank {rank} {_exit_text(proc)}"
            msg = self._message(conn)
            if msg is not None and msg[0] == "error":
                text += f": {_last_line(msg[1])}"
            parts.append(text)
        return "; ".join(parts)

    def _set_fatal(self, reason: str) -> None:
        """Records the first fatal reason and kills every worker, so that rank 0 cannot stay
        blocked on one (its collective or pipe write fails when their sockets close)."""
        with self._lock:
            if self.fatal is not None or self._closing:
                return
            self.fatal = reason
        logger.critical("tensor-parallel engine failed", extra={"fields": {"reason": reason}})
        with self._proc_lock:
            for proc in self._procs:
                if proc.is_alive():
                    proc.kill()

    # ---- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        """Stops every worker (STOP, then SIGKILL after STOP_GRACE_S) and leaves the group.
        Idempotent; safe after a failure."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        atexit.unregister(self.close)
        for ring in self._rings:
            try:
                ring.send(STOP, timeout_s=1.0)
            except (OSError, TimeoutError):
                pass  # that worker is gone or hung: it is killed below
        deadline = time.monotonic() + STOP_GRACE_S
        with self._proc_lock:
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        for conn in self._conns + self.tier_conns:
            conn.close()
        for ring in self._rings:
            ring.close()
        if self._step_started is None:  # never under a collective another thread is in
            leave_group()
        self._store = None
        logger.info("tensor-parallel workers stopped", extra={"fields": {"pids": self.pids}})


def _exit_text(proc: Any) -> str:
    """'(pid 123) was killed by SIGKILL' / '(pid 123) exited with status 1'."""
    code = proc.exitcode
    if code is None:
        return f"(pid {proc.pid}) is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"(pid {proc.pid}) was killed by {name}"
    return f"(pid {proc.pid}) exited with status {code}"


def _last_line(text: str) -> str:
    """The exception line of a traceback."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
