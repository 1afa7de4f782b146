"""Stored responses: an SQLite table, bounded in count and age, scoped to an owner.

`store: true` (OpenAI's default) keeps a finished response with the conversation it
answered, so `previous_response_id` can continue it, and `GET`/`DELETE
/v1/responses/{id}` and `/input_items` can read it. Each row is self-contained (the whole
conversation so far plus the output), so evicting an old response never breaks a newer one
that continued it.

Bounds: at most `max_stored` rows (the oldest evicted on each insert) and `ttl_s` seconds
(older rows are evicted on insert and never returned). A row belongs to the owner that
created it (`appliance.tenancy.response_owner`: today a hash of the API key); any other
owner reads it as absent, so a response id reveals nothing to another key.

SQLite calls block, so every operation runs on a worker thread (`asyncio.to_thread`) and
never on the event loop; one connection serves them in turn under a lock. The file (or
":memory:") is opened at construction, and the table is created if missing, so a restart
finds what was stored before it. Several processes on one host may share the file (WAL
mode, SQLite's own locking): replicas that do serve each other's `previous_response_id`.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STORE_FILE = "responses.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL
)
"""


def default_store_path(environ: dict[str, str]) -> Path:
    """responses.sqlite3 under the appliance's cache directory: $APPLIANCE_CACHE, else
    ~/.cache/appliance (where converted GGUF models go too)."""
    base = environ.get("APPLIANCE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "appliance") / STORE_FILE


def memory_store() -> ResponseStore:
    """A store in memory with the default bounds (tests, and apps built without one)."""
    from appliance.config.schema import ResponsesSection

    d = ResponsesSection()
    return ResponseStore(":memory:", d.max_stored, d.ttl_s)


def open_store(
    path: str | None, max_stored: int, ttl_s: float | None, environ: dict
) -> ResponseStore:
    """The store the YAML's `responses` section describes (`path` None: the default file)."""
    return ResponseStore(path or default_store_path(environ), max_stored, ttl_s)


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str
    created_at: float  # seconds since the epoch (the TTL counts from it)
    response: dict  # the Response object as answered
    input_items: list[dict]  # the conversation it answered (canonical items, ids included)

    def conversation(self) -> list[dict]:
        """What a continuation starts from: the items it answered, then its output."""
        return self.input_items + list(self.response.get("output") or [])


# How long opening a store file waits for another process that holds it (replicas that
# share one file and start together).
OPEN_WAIT_S = 30.0


def _while_locked(op: Callable[[], object], wait_s: float = OPEN_WAIT_S) -> None:
    """Runs `op`, again while the file is locked by another connection, up to `wait_s`.

    Switching a file to WAL needs it alone, and SQLite answers "database is locked" at once
    there instead of waiting out its busy timeout: two replicas sharing one store file that
    started together failed one of them (seen in tests/serving/test_router_replicas.py)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            op()
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() >= deadline:
                raise
            _sleep(0.02)


_sleep = time.sleep  # a seam for the test that holds the file


class ResponseStore:
    """The store; `max_stored` 0 keeps nothing (every `put` is a no-op)."""

    def __init__(
        self,
        path: str | Path,
        max_stored: int,
        ttl_s: float | None,
        clock: Callable[[], float] = time.time,
    ):
        self.path = str(path)
        self.max_stored = max_stored
        self.ttl_s = ttl_s
        self._clock = clock
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        if self.path != ":memory:":  # readers never wait for a writer
            _while_locked(lambda: self._db.execute("PRAGMA journal_mode=WAL"))
        _while_locked(lambda: self._db.execute(_SCHEMA))
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_stored > 0

    # ---- async API (what the frontends call) ---------------------------------------------
    async def put(self, response: dict, owner: str, input_items: list[dict]) -> None:
        """Keeps `response` (its `id` is the key) for `owner`, created now."""
        await asyncio.to_thread(self.put_sync, response, owner, input_items)

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        return await asyncio.to_thread(self.get_sync, response_id, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        return await asyncio.to_thread(self.delete_sync, response_id, owner)

    # ---- the blocking work (on a worker thread) ------------------------------------------
    def put_sync(self, response: dict, owner: str, input_items: list[dict]) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # the write lock first: no upgrade deadlock
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO responses (id, owner, created_at, response, "
                    "input_items) VALUES (?, ?, ?, ?, ?)",
                    (response["id"], owner, self._clock(), json.dumps(response),
                     json.dumps(input_items)),
                )  # fmt: skip
                self._evict()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _evict(self) -> None:
        if self.ttl_s is not None:
            self._db.execute(
                "DELETE FROM responses WHERE created_at < ?", (self._clock() - self.ttl_s,)
            )
        self._db.execute(
            "DELETE FROM responses WHERE seq IN "
            "(SELECT seq FROM responses ORDER BY seq DESC LIMIT -1 OFFSET ?)",
            (self.max_stored,),
        )

    def get_sync(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, owner, created_at, response, input_items FROM responses "
                "WHERE id = ? AND owner = ?",
                (response_id, owner),
            ).fetchone()
        if row is None or self._expired(row[2]):
            return None
        return StoredResponse(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]))

    def delete_sync(self, response_id: str, owner: str) -> bool:
        with self._lock:
            cur = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
            )
        return cur.rowcount > 0

    def count_sync(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def _expired(self, created_at: float) -> bool:
        return self.ttl_s is not None and created_at < self._clock() - self.ttl_s

    def close(self) -> None:
        with self._lock:
            self._db.close()
