"""Rank 0's view of the KV tiers under tensor parallelism: its own `KVTierWorker` plus the
reports of the worker ranks, merged into one (`rank_reports.py`).

Every rank runs the same tier moves: rank 0 submits a step's moves to its own worker here,
and the worker ranks submit them from the step message (`transport.py` carries them) before
they run the step. Each worker rank sends what its tier finished over a pipe of its own
(`tier_report_sender`); a thread here receives them, so a report that completes while the
engine is idle still wakes it (`on_scan`, as a rescan of the shared directory does).

The engine uses this exactly as a `KVTierWorker` (`submit`, `poll`, `has_report`,
`close`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from engine.core.step_io import KVMove, KVTierReport
from engine.worker.kv_tier.rank_reports import RankReportMerger
from engine.worker.kv_tier.tier_worker import KVTierWorker

logger = logging.getLogger(__name__)

_POLL_SLICE_S = 0.002


class ShardedTierWorker:
    """See the module docstring. `conns[i]` receives rank i + 1's reports."""

    def __init__(self, local: KVTierWorker, conns: list[Connection], merger: RankReportMerger):
        self.local = local
        self.disk = local.disk
        self._conns = list(conns)
        self._merger = merger
        self._cond = threading.Condition()
        self._closed = False
        self.on_scan: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._receive, name="kv-tier-ranks", daemon=True)
        self._thread.start()

    # ---- the engine thread's side --------------------------------------------------------
    def submit(self, saves: list[KVMove], loads: list[KVMove], deletes: list[bytes]) -> None:
        self.local.submit(saves, loads, deletes)

    def poll(self, wait_s: float = 0.0) -> KVTierReport | None:
        """What every rank has finished since the last poll, or None; waits up to `wait_s`
        for it (an empty step waiting on loads must not spin)."""
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            mine = self.local.poll(min(left, _POLL_SLICE_S) if left > 0 else 0.0)
            with self._cond:
                if mine is not None:
                    self._merger.add(0, mine)
                out = self._merger.take()
                if out is not None or left <= 0:
                    return out
                if not self.local.outstanding:
                    self._cond.wait(min(left, _POLL_SLICE_S))

    def has_report(self) -> bool:
        with self._cond:
            return self._merger.has_report() or self.local.has_report()

    def close(self) -> None:
        self._closed = True
        self.local.close()

    # ---- the receiving thread --------------------------------------------------------------
    def _receive(self) -> None:
        ranks = {id(c): r for r, c in enumerate(self._conns, 1)}
        live = list(self._conns)
        while live and not self._closed:
            try:
                ready_conns = wait(live, timeout=0.5)
            except (OSError, ValueError):  # the pool closed the pipes: shutting down
                return
            for conn in ready_conns:
                try:
                    report = conn.recv()
                except (EOFError, OSError, ValueError):  # that rank is gone: the pool says why
                    live.remove(conn)
                    continue
                with self._cond:
                    self._merger.add(ranks[id(conn)], report)
                    ready = self._merger.has_report()
                    self._cond.notify_all()
                if ready and self.on_scan is not None:
                    self.on_scan()


def tier_report_sender(tier: KVTierWorker, conn: Connection) -> threading.Thread:
    """A worker rank's thread that sends each report of its tier to rank 0 as it comes
    (daemon: it ends with the process)."""

    def run() -> None:
        while True:
            report = tier.wait_report()
            try:
                conn.send(report)
            except (OSError, ValueError):  # rank 0 is gone: the process is about to end
                return

    t = threading.Thread(target=run, name="kv-tier-report", daemon=True)
    t.start()
    return t
