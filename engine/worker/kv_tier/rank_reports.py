"""Under tensor parallelism, one KV tier report out of every rank's.

Each rank holds its own heads' share of every KV block, so each rank saves and loads its
share with a `KVTierWorker` of its own, into a disk directory of its own (the fingerprint
names the rank). The core keeps one index for all of them and must only hear of a move once
it is done on every rank:

- a save's block may be reused (`copied`) only when every rank has copied its share out;
- a block is `stored` in a tier only when every rank stored its share; if any rank failed,
  it is `store_failed`, and the shares the other ranks did write are reported `orphaned`:
  the core deletes them on every rank, so that no directory holds bytes its index does not
  count;
- a load is `loaded` only when every rank filled its share; one rank's failure makes it
  `load_failed` (the request computes the block, on every rank, as without a tier);
- a file another replica wrote (`scan_added`) counts once every rank's directory has it; one
  removed on any rank (`scan_removed`) is gone for all;
- the first `disk_error` of any rank switches the disk tier off (the core stops using it).

Torch-free and single-threaded: the caller (`tp_tier_worker.py`) serialises `add` and `take`.
"""

from __future__ import annotations

from collections import Counter

from engine.core.step_io import DISK_TIER, KVTierReport


class RankReportMerger:
    """Combines the reports of `size` ranks (see the module docstring)."""

    def __init__(self, size: int):
        self.size = size
        self._copied: Counter[int] = Counter()
        self._stores: dict[tuple[bytes, str], list[int]] = {}  # -> [reported, succeeded]
        self._loads: dict[int, list] = {}  # block id -> [reported, first failure or None]
        self._added: dict[bytes, tuple[set[int], int, float]] = {}  # -> ranks, bytes, mtime
        self._out = KVTierReport()

    def add(self, rank: int, report: KVTierReport) -> None:
        """Takes in what `rank` finished."""
        out = self._out
        for block_id in report.copied:
            self._copied[block_id] += 1
            if self._copied[block_id] == self.size:
                del self._copied[block_id]
                out.copied.append(block_id)
        for key in report.stored:
            self._store(key, ok=True)
        for key in report.store_failed:
            self._store(key, ok=False)
        for block_id in report.loaded:
            self._load(block_id, None)
        for block_id, why in report.load_failed:
            self._load(block_id, f"rank {rank}: {why}")
        for h, nbytes, mtime in report.scan_added:
            ranks, _, latest = self._added.get(h, (set(), nbytes, mtime))
            ranks.add(rank)
            if len(ranks) == self.size:
                self._added.pop(h, None)
                out.scan_added.append((h, nbytes, max(latest, mtime)))
            else:
                self._added[h] = (ranks, nbytes, max(latest, mtime))
        for h in report.scan_removed:
            self._added.pop(h, None)
            if h not in out.scan_removed:
                out.scan_removed.append(h)
        if report.disk_error is not None and out.disk_error is None:
            out.disk_error = f"rank {rank}: {report.disk_error}"

    def _store(self, key: tuple[bytes, str], ok: bool) -> None:
        tally = self._stores.setdefault(key, [0, 0])
        tally[0] += 1
        tally[1] += ok
        if tally[0] < self.size:
            return
        del self._stores[key]
        if tally[1] == self.size:
            self._out.stored.append(key)
            return
        self._out.store_failed.append(key)
        if tally[1] and key[1] == DISK_TIER:
            self._out.orphaned.append(key[0])

    def _load(self, block_id: int, failure: str | None) -> None:
        tally = self._loads.setdefault(block_id, [0, None])
        tally[0] += 1
        if failure is not None and tally[1] is None:
            tally[1] = failure
        if tally[0] < self.size:
            return
        del self._loads[block_id]
        if tally[1] is None:
            self._out.loaded.append(block_id)
        else:
            self._out.load_failed.append((block_id, tally[1]))

    def seed_listings(
        self, listings: list[list[tuple[bytes, int, float]]]
    ) -> list[tuple[bytes, int, float]]:
        """Start-up: every rank's directory listing, rank 0 first. Returns the entries every
        rank holds (the index takes those); the hashes only some ranks hold (a save cut
        short) go out as `orphaned` with the next `take`."""
        seen: dict[bytes, tuple[int, int, float]] = {}
        for listing in listings:
            for h, nbytes, mtime in listing:
                count, _, latest = seen.get(h, (0, nbytes, mtime))
                seen[h] = (count + 1, nbytes, max(latest, mtime))
        whole = [(h, n, t) for h, (c, n, t) in seen.items() if c == self.size]
        self._out.orphaned.extend(h for h, (c, _, _) in seen.items() if c < self.size)
        return whole

    def take(self) -> KVTierReport | None:
        """What is complete on every rank since the last take, or None."""
        out, self._out = self._out, KVTierReport()
        return out if out else None

    def has_report(self) -> bool:
        return bool(self._out)
