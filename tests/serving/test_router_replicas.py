"""Two `appliance serve` replicas behind vllm-router on loopback (docs/scaling.md).

What data-parallel scale-out must give, checked on real processes: cache-aware routing keeps
a conversation (a growing shared prefix) on one replica, whose prefix-cache hit counter
rises while the other's does not; requests with unrelated prompts spread over both
replicas; and a replica killed while it holds a request is routed around, so every request
sent after the kill is answered. Each replica's own /metrics says where requests went.

The tests share one set of processes (module fixture) and run in file order; the last one
kills a replica. Nothing waits on the clock: a replica's steps are held through a gate file
(`tests.support.fault_launcher`), so "in flight" is a state the test creates and observes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.router import (
    Replica,
    RouterProcess,
    cannot_run_reason,
    start_replica,
    start_router,
)
from tests.support.served_stack import gauges
from tests.support.waiting import HANG_S, wait_for

_REASON = cannot_run_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

SYSTEM = "You are a helpful assistant. Answer every question about the garden briefly."
# Unrelated prompts: no two share a leading token run the cache-aware policy would follow.
DISTINCT = (
    "Water boils at one hundred degrees.",
    "Computers process numbers and words.",
    "Once upon a time there was a little girl.",
    "The dragon slept in a cave under the hill.",
)
HITS = "appliance_prefix_cache_hits_total"
PROMPT_TOKENS = "appliance_prompt_tokens_total"
IN_FLIGHT = "appliance_requests_in_flight"


@dataclass
class Cluster:
    replicas: list[Replica]
    router: RouterProcess
    conversation: list[dict]  # the chat so far (test a); later turns extend it


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router")
    replicas: list[Replica] = []
    router = None
    # One Responses store file for both replicas (one host): each continues the other's.
    sets = {"model.max_model_len": 256, "cache.num_kv_blocks": 64,
            "responses.store_path": str(tmp / "responses.sqlite3")}  # fmt: skip
    try:
        # Both replicas load at once (each is one process with one torch thread).
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(start_replica, tiny_llama_dir, tmp / f"gate{i}", **sets)
                for i in range(2)
            ]
        # Keep every replica that started (the finally kills it), then raise any failure.
        replicas.extend(f.result() for f in futures if f.exception() is None)
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        router = start_router([r.url for r in replicas], tmp / "router.log")
        yield Cluster(replicas, router, [{"role": "system", "content": SYSTEM}])
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.gate.release()
            r.serve.kill()


def _metric(replica: Replica, name: str) -> float:
    return gauges(replica.url).get(name, 0.0)


def _snapshot(cluster: Cluster, name: str) -> list[float]:
    return [_metric(r, name) for r in cluster.replicas]


def _chat_turn(cluster: Cluster, question: str) -> dict:
    """The next user turn through the router; the answer joins the conversation."""
    cluster.conversation.append({"role": "user", "content": question})
    body = {"messages": list(cluster.conversation), "max_tokens": 4, "temperature": 0}
    return {"url": f"{cluster.router.url}/v1/chat/completions", "json": body}


def _post(cluster: Cluster, req: dict) -> httpx.Response:
    r = httpx.post(req["url"], json=req["json"], timeout=HANG_S)
    assert r.status_code == 200, f"{r.status_code} {r.text}\n{cluster.router.log_tail()}"
    return r


def _answer(cluster: Cluster, r: httpx.Response) -> None:
    text = r.json()["choices"][0]["message"]["content"]
    cluster.conversation.append({"role": "assistant", "content": text})


def _completion(cluster: Cluster, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    return {"url": f"{cluster.router.url}/v1/completions", "json": body}


def test_cache_aware_routing_keeps_a_conversation_on_one_replica(cluster: Cluster) -> None:
    hits0, tokens0 = _snapshot(cluster, HITS), _snapshot(cluster, PROMPT_TOKENS)
    for q in ("Which flowers grow in the garden?", "And which trees?", "Who waters them?"):
        _answer(cluster, _post(cluster, _chat_turn(cluster, q)))
    hits, tokens = _snapshot(cluster, HITS), _snapshot(cluster, PROMPT_TOKENS)
    served = [i for i in range(2) if tokens[i] > tokens0[i]]
    assert len(served) == 1, f"prompt tokens {tokens0} -> {tokens}: the turns were split"
    home, other = served[0], 1 - served[0]
    assert hits[home] > hits0[home], f"no prefix-cache hit on the serving replica: {hits}"
    assert hits[other] == hits0[other], f"hits moved on the idle replica: {hits0} -> {hits}"


def test_unrelated_prompts_spread_over_both_replicas(cluster: Cluster) -> None:
    """Each request is held in flight before the next is sent, so the router sees the load
    it created: its shortest-queue choice (prompts below the cache threshold) must use both
    replicas. Then the steps run and every request is answered."""
    for r in cluster.replicas:
        r.gate.hold()
    results: dict[int, int] = {}

    def send(i: int) -> None:
        results[i] = httpx.post(**_completion(cluster, DISTINCT[i]), timeout=HANG_S).status_code

    threads = []
    try:
        for i in range(len(DISTINCT)):
            threads.append(threading.Thread(target=send, args=(i,), daemon=True))
            threads[-1].start()
            wait_for(
                lambda n=i + 1: sum(_snapshot(cluster, IN_FLIGHT)) == n,
                f"request {i} in flight on a replica",
            )
        held = _snapshot(cluster, IN_FLIGHT)
    finally:
        for r in cluster.replicas:
            r.gate.release()
        for t in threads:
            t.join(HANG_S)
    assert all(n >= 1 for n in held), f"in flight per replica: {held}"
    assert results == dict.fromkeys(range(len(DISTINCT)), 200), results


def test_replicas_sharing_a_store_file_continue_each_others_responses(cluster: Cluster) -> None:
    first, other = cluster.replicas
    body = {"input": "The capital of France is Paris.", "max_output_tokens": 3, "temperature": 0}
    r0 = httpx.post(f"{first.url}/v1/responses", json=body, timeout=HANG_S).json()
    # the other replica reads it and continues it; so does whichever the router picks
    assert httpx.get(f"{other.url}/v1/responses/{r0['id']}", timeout=HANG_S).status_code == 200
    prev = r0["id"]
    for url in [other.url] + [cluster.router.url] * 3:
        nxt = {**body, "input": "And then?", "previous_response_id": prev}
        r = httpx.post(f"{url}/v1/responses", json=nxt, timeout=HANG_S)
        assert r.status_code == 200, f"{r.status_code} {r.text}\n{cluster.router.log_tail()}"
        prev = r.json()["id"]
    items = httpx.get(f"{first.url}/v1/responses/{prev}/input_items", params={"limit": 100},
                      timeout=HANG_S).json()["data"]  # fmt: skip
    # the five inputs (and whatever text the four answers before the last had), newest first
    users = [i["content"][0]["text"] for i in items if i["role"] == "user"]
    assert users == ["And then?"] * 4 + [body["input"]]


def test_a_killed_replica_is_routed_around(cluster: Cluster) -> None:
    """The conversation's replica is killed while it holds the conversation's next turn.
    That request had started (it may be lost); every request sent after the kill, the
    conversation's next turn included (the cache-aware policy's first choice is the dead
    replica), is answered by the survivor."""
    tokens0 = _snapshot(cluster, PROMPT_TOKENS)
    _answer(cluster, _post(cluster, _chat_turn(cluster, "Is the garden big?")))
    tokens = _snapshot(cluster, PROMPT_TOKENS)
    home = next(i for i in range(2) if tokens[i] > tokens0[i])
    victim, survivor = cluster.replicas[home], cluster.replicas[1 - home]

    victim.gate.hold()
    started: dict[str, object] = {}

    def send_started() -> None:
        try:
            started["status"] = httpx.post(**_chat_turn(cluster, "Is it old?"), timeout=HANG_S)
        except httpx.HTTPError as e:
            started["status"] = e

    t = threading.Thread(target=send_started, daemon=True)
    t.start()
    wait_for(lambda: _metric(victim, IN_FLIGHT) == 1, "the next turn held on its replica")
    victim.serve.kill()  # SIGKILL: a crash, not a drain

    before = _metric(survivor, PROMPT_TOKENS)
    cluster.conversation.pop()  # the started turn's question; ask again after the kill
    _answer(cluster, _post(cluster, _chat_turn(cluster, "Is it old?")))
    for prompt in DISTINCT:
        _post(cluster, _completion(cluster, prompt))
    assert _metric(survivor, PROMPT_TOKENS) > before
    t.join(HANG_S)
    assert not t.is_alive() and "status" in started  # the started one ended, however it ended
