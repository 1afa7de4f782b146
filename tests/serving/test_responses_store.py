"""The Responses store on its own: bounded (the oldest evicted, never past the bound), aged
out, scoped to the owner, surviving a reopen, and never run on the event loop."""

from __future__ import annotations

import asyncio
import threading

from appliance.responses.store import ResponseStore, default_store_path
from appliance.tenancy import response_owner


def _resp(i: int) -> dict:
    return {"id": f"resp_{i}", "output": [{"id": f"msg_{i}", "type": "message"}]}


def test_the_bound_evicts_the_oldest_and_never_grows_past_it():
    store = ResponseStore(":memory:", max_stored=3, ttl_s=None)
    for i in range(7):
        store.put_sync(_resp(i), "o", [])
        assert store.count_sync() == min(i + 1, 3)
    assert [store.get_sync(f"resp_{i}", "o") is not None for i in range(7)] == [False] * 4 + [
        True
    ] * 3


def test_a_response_older_than_the_ttl_is_gone_and_evicted_on_the_next_put():
    now = [0.0]
    store = ResponseStore(":memory:", 100, ttl_s=10.0, clock=lambda: now[0])
    store.put_sync(_resp(1), "o", [])
    now[0] = 10.0
    assert store.get_sync("resp_1", "o") is not None
    now[0] = 10.5
    assert store.get_sync("resp_1", "o") is None and store.count_sync() == 1
    store.put_sync(_resp(2), "o", [])
    assert store.count_sync() == 1


def test_another_owner_reads_and_deletes_nothing():
    store = ResponseStore(":memory:", 10, None)
    a, b = response_owner("key-a"), response_owner("key-b")
    assert a != b and a != "" and "key-a" not in a
    store.put_sync(_resp(1), a, [{"id": "msg_in"}])
    assert store.get_sync("resp_1", b) is None and not store.delete_sync("resp_1", b)
    rec = store.get_sync("resp_1", a)
    assert rec.input_items == [{"id": "msg_in"}]
    assert rec.conversation() == [{"id": "msg_in"}, {"id": "msg_1", "type": "message"}]
    assert store.delete_sync("resp_1", a) and store.get_sync("resp_1", a) is None


def test_a_file_store_survives_a_reopen(tmp_path):
    path = tmp_path / "sub" / "r.sqlite3"
    store = ResponseStore(path, 10, None)
    store.put_sync(_resp(1), "o", [])
    store.close()
    again = ResponseStore(path, 10, None)
    assert again.get_sync("resp_1", "o").response == _resp(1)


def test_zero_max_stored_keeps_nothing():
    store = ResponseStore(":memory:", 0, None)
    store.put_sync(_resp(1), "o", [])
    assert not store.enabled and store.count_sync() == 0


def test_async_calls_run_off_the_event_loop_thread():
    store = ResponseStore(":memory:", 10, None)
    seen: list[int] = []
    real = store.get_sync

    def spy(*a):
        seen.append(threading.get_ident())
        return real(*a)

    store.get_sync = spy  # type: ignore[method-assign]

    async def main() -> int:
        await store.put(_resp(1), "o", [])
        assert (await store.get("resp_1", "o")) is not None
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert seen and all(t != loop_thread for t in seen)


def test_the_default_path_is_under_the_appliance_cache(tmp_path):
    assert default_store_path({"APPLIANCE_CACHE": str(tmp_path)}) == tmp_path / "responses.sqlite3"


def test_opening_a_store_file_another_process_holds_waits_for_it(tmp_path, monkeypatch):
    """Replicas sharing one store file start together: switching the file to WAL needs it
    alone and SQLite refuses at once ("database is locked"), which crashed one replica.
    Opening now retries while the file is held: here a connection holds it exclusively until
    the opener has been refused once (the retry seam signals it), then lets go."""
    import sqlite3

    from appliance.responses import store as store_mod

    path = tmp_path / "responses.sqlite3"
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    refused = threading.Event()
    real_sleep = store_mod._sleep

    def sleep(s: float) -> None:
        refused.set()
        real_sleep(s)

    monkeypatch.setattr(store_mod, "_sleep", sleep)
    opened: list = []
    t = threading.Thread(target=lambda: opened.append(ResponseStore(path, 10, None)))
    t.start()
    assert refused.wait(60)
    holder.execute("COMMIT")
    holder.close()
    t.join(60)
    assert opened and opened[0].count_sync() == 0
    opened[0].put_sync(_resp(1), "o", [])
    assert ResponseStore(path, 10, None).get_sync("resp_1", "o") is not None
