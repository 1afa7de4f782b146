"""A client that leaves costs nothing, and a request is checked whole before any of it runs.

Issue 28, C8: a non-streamed completion of many prompts whose client closes the socket
must have every prompt's engine request aborted (counted as a 499), whether the client
leaves while the prompts are being submitted or while they wait for their answer. C9: a
request with one bad prompt among many is refused before any prompt reaches the engine.

Structural: the engine's steps are held (`StepGate`), so nothing can finish before the
client leaves; the verdict is what the engine still holds and what it counted.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.served_stack import Stack, gauges, served, tiny_engine, wait_idle_and_free
from tests.support.waiting import HANG_S, StepGate, wait_for

PROMPTS = 24


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    with served(tiny_engine(tiny_llama_dir, max_num_seqs=64, max_queue_len=256)) as s:
        yield s


@pytest.fixture()
def s(stack: Stack) -> Iterator[Stack]:
    yield stack
    wait_idle_and_free(stack.aeng)


def _counter(s: Stack, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{s.url}/metrics", timeout=HANG_S).text
    return sum(
        sample.value
        for fam in text_string_to_metric_families(text)
        for sample in fam.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def _send(s: Stack, body: dict) -> socket.socket:
    """Sends a POST /v1/completions over a raw socket and returns it, unread."""
    host, port = s.url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=HANG_S)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return sock


def _body(n: int = PROMPTS) -> dict:
    return {"prompt": [f"prompt number {i}" for i in range(n)], "max_tokens": 60,
            "ignore_eos": True}  # fmt: skip


def test_a_gone_client_aborts_every_prompt_of_a_waiting_answer(s) -> None:
    aborts = _counter(s, "appliance_requests_finished_total", finish_reason="abort")
    gone = _counter(s, "appliance_http_responses_total", status="499")
    with StepGate(s.aeng.engine) as gate:
        sock = _send(s, _body())
        wait_for(lambda: s.aeng.num_in_flight == PROMPTS, "every prompt queued")
        sock.close()
        wait_for(lambda: s.aeng.num_in_flight == 0, "every prompt aborted", timeout=30)
        assert gate.steps == 0  # nothing ran: the gate held every step
    wait_for(lambda: _counter(s, "appliance_http_responses_total", status="499") == gone + 1,
             "the 499 counted")  # fmt: skip
    assert (
        _counter(s, "appliance_requests_finished_total", finish_reason="abort") == aborts + PROMPTS
    )


def test_a_client_gone_while_its_prompts_are_submitted_aborts_them_all(s) -> None:
    """The client leaves while the prompts are still being prepared (one of them held)."""
    eng = s.aeng.engine
    real = eng.prepare_request
    held, release = threading.Event(), threading.Event()

    def prepare(request_id, *a, **kw):
        if request_id.endswith("-5"):
            held.set()
            release.wait(HANG_S)
        return real(request_id, *a, **kw)

    eng.prepare_request = prepare
    s.aeng.offload_prompt_chars, threshold = 0, s.aeng.offload_prompt_chars  # off the loop
    generated = gauges(s.url)["appliance_generation_tokens_total"]
    gone = _counter(s, "appliance_http_responses_total", status="499")
    try:
        with StepGate(eng, permits=None):  # open: whatever is queued would run
            sock = _send(s, _body())
            held.wait(HANG_S)
            sock.close()
            wait_for(lambda: _counter(s, "appliance_http_responses_total", status="499") > gone,
                     "the 499 counted while a prompt is still being prepared", timeout=30)  # fmt: skip
            assert s.aeng.num_in_flight == 0
            release.set()
            wait_idle_and_free(s.aeng)
    finally:
        release.set()
        eng.prepare_request = real
        s.aeng.offload_prompt_chars = threshold
    assert gauges(s.url)["appliance_generation_tokens_total"] == generated  # none ran


def test_one_bad_prompt_refuses_the_request_before_any_prompt_runs(s) -> None:
    generated = gauges(s.url)["appliance_generation_tokens_total"]
    body = _body(40)
    body["prompt"].append("word " * 400)  # beyond the 128-token context
    with StepGate(s.aeng.engine, permits=None):
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    wait_idle_and_free(s.aeng)
    assert gauges(s.url)["appliance_generation_tokens_total"] == generated


def test_every_prompt_of_a_request_reaches_the_engine_in_one_handoff(s) -> None:
    """Adds acknowledged one engine-loop iteration each (one step each when the engine is
    busy) made a 600-prompt request take as long to submit as to run, so a client that left
    meanwhile was noticed only when most of it had run."""
    from engine.engine_inbox import Add

    batches: list[int] = []
    real = s.aeng._handle_inbox

    def handle(inbox, out):
        adds = sum(isinstance(item, Add) for item in inbox)
        if adds:
            batches.append(adds)
        return real(inbox, out)

    s.aeng._handle_inbox = handle
    try:
        with StepGate(s.aeng.engine):
            sock = _send(s, _body())
            wait_for(lambda: s.aeng.num_in_flight == PROMPTS, "every prompt queued")
            sock.close()
            wait_for(lambda: s.aeng.num_in_flight == 0, "every prompt aborted")
    finally:
        del s.aeng._handle_inbox
    assert batches == [PROMPTS], batches
