"""Carries out the KV tier moves a step names, on threads of its own, never the engine's.

    engine thread                      copy thread             writer thread      reader thread
    ─────────────                      ───────────             ─────────────      ─────────────
    submit(saves, loads, deletes) ─▶   save: pool -> host slot  deletes (evicted)
      (returns at once)                  or staging buffer,     writes: header +   disk loads:
                                         report `copied` ─────▶   payload, atomic    read, check,
                                       host loads: slot -> pool  rename, `stored`   copy in,
    poll() ◀── KVTierReport ────────── (every thread adds to one report)            `loaded`
                                                                  rescans (shared
                                                                   directory)

One thread per kind of work keeps each FIFO: a block's copy precedes its file's write, and a
delete the core decided before a write runs before it, so the directory never exceeds its
bytes. Disk loads have their own thread so that a backlog of writes never delays a request
waiting for its prefix.

Failures: a missing, torn, corrupt or foreign file is one failed load (the request computes
the block; the file is deleted if it was junk); ENOSPC, EIO, EDQUOT or EROFS switch the disk
tier off for the rest of the run (`disk_error`, one log line), the host tier and the pool
going on as before.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.step_io import DISK_TIER, HOST_TIER, KVMove, KVTierReport
from engine.worker.kv_tier.block_copier import BlockCopier
from engine.worker.kv_tier.block_file import BlockFileError, encode_header
from engine.worker.kv_tier.disk_store import DiskStore, is_fatal
from engine.worker.kv_tier.host_buffers import HostTierSlots, StagingBuffers, as_bytes, from_bytes

logger = logging.getLogger(__name__)

_STOP = object()
# Staging buffers for disk writes: this many bytes' worth, at least 2 blocks.
STAGING_BYTES = 64 << 20


@dataclass
class _Save:
    move: KVMove
    fence: Any


class KVTierWorker:
    """The worker's side of the tiers (see the module docstring). `host` and `disk` are
    None for a tier that is off; `rescan_s`: how often the writer lists the directory for
    files other replicas added or removed (None: never)."""

    def __init__(
        self,
        copier: BlockCopier,
        host: HostTierSlots | None,
        disk: DiskStore | None,
        *,
        rescan_s: float | None = None,
        known_files: set[bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.copier = copier
        self.host = host
        self.disk = disk
        self.rescan_s = rescan_s
        self._clock = clock
        self._known = set(known_files or ())  # files believed in the directory (for rescans)
        self._disk_off = disk is None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._report = KVTierReport()
        self._outstanding = 0
        self._copy_q: queue.SimpleQueue = queue.SimpleQueue()
        self._write_q: queue.Queue = queue.Queue()
        self._read_q: queue.SimpleQueue = queue.SimpleQueue()
        self._staging: StagingBuffers | None = None
        self._threads: list[threading.Thread] = []
        # Called (on the writer thread) when a rescan found changes while nothing else may
        # be stepping the engine: its owner wakes the engine loop to take the report in.
        self.on_scan: Callable[[], None] | None = None
        pin = copier.cuda
        if disk is not None:
            per_block = disk.payload_bytes
            self._staging = StagingBuffers(
                max(2, STAGING_BYTES // max(1, per_block)), copier.block_shape, copier.dtype, pin
            )
        for name, target in (
            ("kv-tier-copy", self._copy_loop),
            ("kv-tier-write", self._write_loop),
            ("kv-tier-read", self._read_loop),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    # ---- the engine thread's side --------------------------------------------------------
    def submit(self, saves: list[KVMove], loads: list[KVMove], deletes: list[bytes]) -> None:
        """Queues a step's moves and returns at once."""
        if not (saves or loads or deletes):
            return
        fence = self.copier.fence() if saves else None
        with self._lock:
            self._outstanding += len(saves) + len(loads) + len(deletes)
        for h in deletes:
            self._write_q.put(("delete", h, None, None))
        for m in saves:
            self._copy_q.put(_Save(m, fence))
        for m in loads:
            if m.host_slot >= 0:
                self._copy_q.put(m)
            else:
                self._read_q.put(m)

    def poll(self, wait_s: float = 0.0) -> KVTierReport | None:
        """What finished since the last poll, or None. `wait_s`: wait up to that long for
        something to finish when nothing has yet but moves are outstanding (an empty step
        waiting on loads must not spin)."""
        with self._cond:
            if wait_s > 0 and not self._report and self._outstanding:
                self._cond.wait(wait_s)
            report, self._report = self._report, KVTierReport()
        return report if report else None

    def wait_report(self) -> KVTierReport:
        """Blocks until something finished, then takes it (a tensor-parallel worker rank
        forwards its reports to rank 0 this way)."""
        with self._cond:
            while not self._report:
                self._cond.wait()
            report, self._report = self._report, KVTierReport()
        return report

    def has_report(self) -> bool:
        """Something finished that the core has not taken in yet."""
        with self._lock:
            return bool(self._report)

    @property
    def outstanding(self) -> int:
        """Moves not yet done (a save: copied and stored; a load: loaded; a delete)."""
        return self._outstanding

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until every move submitted so far is done, or `timeout_s` passed; True if
        idle. For the drain, when no step runs any more."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while self._outstanding:
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self) -> None:
        self._copy_q.put(_STOP)
        self._write_q.put(("stop", None, None, None))
        self._read_q.put(_STOP)
        for t in self._threads:
            t.join(timeout=5.0)

    # ---- reporting (any thread) ----------------------------------------------------------
    def _add(self, done: int = 0, **items: Any) -> None:
        with self._cond:
            r = self._report
            for name, value in items.items():
                if name == "disk_error":
                    r.disk_error = r.disk_error or value
                else:
                    getattr(r, name).append(value)
            self._outstanding -= done
            self._cond.notify_all()

    def _disk_failed(self, e: OSError) -> None:
        if self._disk_off:
            return
        self._disk_off = True
        reason = f"{type(e).__name__}: [Errno {e.errno}] {e.strerror}"
        logger.error("kv disk tier failed, switching it off: %s", reason)
        self._add(disk_error=reason)

    # ---- copy thread ---------------------------------------------------------------------
    def _copy_loop(self) -> None:
        while True:
            item = self._copy_q.get()
            if item is _STOP:
                return
            try:
                if isinstance(item, _Save):
                    self._save(item)
                else:
                    self._load_from_host(item)
            except Exception:  # noqa: BLE001 - a bug must not kill the thread and hang blocks
                logger.exception("kv tier copy failed")
                self._copy_failed(item)

    def _save(self, item: _Save) -> None:
        m = item.move
        writes_disk = m.to_disk and not self._disk_off
        if m.host_slot >= 0 and self.host is not None:
            dst = self.host.slot(m.host_slot)
            self.copier.copy_out(m.block_id, dst, item.fence)
            staging = None
        else:
            staging = self._acquire_staging() if writes_disk else None
            if staging is None:  # no disk write after all (off, or backed up): no copy
                self._add(done=1, copied=m.block_id)
                if m.to_disk:
                    self._add(store_failed=(m.block_hash, DISK_TIER))
                return
            dst = staging
            self.copier.copy_out(m.block_id, dst, item.fence)
        # The block may be reused now; the host slot is readable.
        with self._cond:
            self._report.copied.append(m.block_id)
            if m.host_slot >= 0:
                self._report.stored.append((m.block_hash, HOST_TIER))
            if not writes_disk:
                self._outstanding -= 1
            self._cond.notify_all()
        if writes_disk:
            self._write_q.put(("write", m.block_hash, dst, staging))
        elif m.to_disk:
            self._add(store_failed=(m.block_hash, DISK_TIER))

    def _acquire_staging(self) -> torch.Tensor | None:
        """A free staging buffer, or None when every one waits for the disk: then the save
        is dropped rather than the pool's block held until the disk catches up (a slow disk
        costs cache entries, never KV blocks)."""
        if self._disk_off or self._staging is None:
            return None
        return self._staging.acquire(timeout=0.0)

    def _load_from_host(self, m: KVMove) -> None:
        assert self.host is not None
        self.copier.copy_in(self.host.slot(m.host_slot), m.block_id)
        self._add(done=1, loaded=m.block_id)

    def _copy_failed(self, item: Any) -> None:
        if isinstance(item, _Save):
            m = item.move
            self._add(done=1, copied=m.block_id)
            if m.host_slot >= 0:
                self._add(store_failed=(m.block_hash, HOST_TIER))
            if m.to_disk:
                self._add(store_failed=(m.block_hash, DISK_TIER))
        else:
            self._add(done=1, load_failed=(item.block_id, "host copy failed"))

    # ---- writer thread -------------------------------------------------------------------
    def _write_loop(self) -> None:
        last_scan = self._clock()
        while True:
            timeout = None
            if self.rescan_s is not None and not self._disk_off:
                timeout = max(0.0, last_scan + self.rescan_s - self._clock())
            try:
                kind, h, src, staging = self._write_q.get(timeout=timeout)
            except queue.Empty:
                self._rescan()
                last_scan = self._clock()
                continue
            if kind == "stop":
                return
            try:
                if kind == "write":
                    self._write(h, src)
                elif kind == "delete":
                    self._delete(h)
            except Exception:  # noqa: BLE001
                logger.exception("kv tier %s failed", kind)
                if kind == "write":
                    self._add(done=1, store_failed=(h, DISK_TIER))
                else:
                    self._add(done=1)
            finally:
                if staging is not None and self._staging is not None:
                    self._staging.release(staging)

    def _write(self, h: bytes, src: torch.Tensor) -> None:
        disk = self.disk
        if self._disk_off or disk is None:
            self._add(done=1, store_failed=(h, DISK_TIER))
            return
        payload = as_bytes(src)
        try:
            disk.write(h, encode_header(disk.fingerprint, h, payload), payload)
        except OSError as e:
            if is_fatal(e):
                self._disk_failed(e)
            else:
                logger.warning("kv disk tier write failed block=%s: %s", h.hex()[:16], e)
            self._add(done=1, store_failed=(h, DISK_TIER))
            return
        self._known.add(h)
        self._add(done=1, stored=(h, DISK_TIER))

    def _delete(self, h: bytes) -> None:
        if not self._disk_off and self.disk is not None:
            self._known.discard(h)
            try:
                self.disk.delete(h)
            except OSError as e:
                if is_fatal(e):
                    self._disk_failed(e)
        self._add(done=1)

    def _rescan(self) -> None:
        """Lists the directory and reports what other processes added or removed."""
        assert self.disk is not None
        try:
            entries = self.disk.scan()
        except OSError as e:
            if is_fatal(e):
                self._disk_failed(e)
            return
        now = {e.block_hash: e for e in entries}
        added = [(h, e.nbytes, e.mtime) for h, e in now.items() if h not in self._known]
        removed = [h for h in self._known if h not in now]
        self._known = set(now)
        if added or removed:
            with self._cond:
                self._report.scan_added.extend(added)
                self._report.scan_removed.extend(removed)
                self._cond.notify_all()
            if self.on_scan is not None:
                self.on_scan()

    # ---- reader thread -------------------------------------------------------------------
    def _read_loop(self) -> None:
        buf = self.disk.read_buffer() if self.disk is not None else None
        while True:
            m = self._read_q.get()
            if m is _STOP:
                return
            try:
                why = self._load_from_disk(m, buf)
            except Exception as e:  # noqa: BLE001
                logger.exception("kv tier disk load failed")
                why = f"{type(e).__name__}: {e}"
            if why is None:
                self._add(done=1, loaded=m.block_id)
            else:
                self._add(done=1, load_failed=(m.block_id, why))

    def _load_from_disk(self, m: KVMove, buf: memoryview | None) -> str | None:
        disk = self.disk
        if self._disk_off or disk is None or buf is None:
            return "disk tier off"
        try:
            payload = disk.read(m.block_hash, buf)
        except FileNotFoundError:
            self._known.discard(m.block_hash)
            return "file gone"
        except BlockFileError as e:
            self._known.discard(m.block_hash)
            return f"bad file: {e}"
        except OSError as e:
            if is_fatal(e):
                self._disk_failed(e)
            return f"{type(e).__name__}: {e}"
        self.copier.copy_in(
            from_bytes(payload, self.copier.dtype, self.copier.block_shape), m.block_id
        )
        return None
