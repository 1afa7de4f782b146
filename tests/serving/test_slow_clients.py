"""Slow and vanishing HTTP clients cannot hold connections or raise false alarms.

- A connection that sends nothing, or half a request line and headers, is closed after
  `server.header_timeout_s` (uvicorn alone never closes it), also on a kept-alive
  connection after its first answer.
- A request whose body stops arriving gets 408 after `server.body_timeout_s`, and the
  connection is closed.
- A client that disconnects mid-upload is counted as a disconnect (499), like every other
  disconnect: no 500 in `appliance_http_responses_total`, no error logged.

The timeouts are configured tiny; the verdict is the server closing the socket (`recv`
returns b""), and the socket's own timeout (HANG_S) is only the hang guard.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import ServerConfig
from appliance.http.app import build_app
from engine.async_engine import AsyncEngine
from tests.support.fake_engine import FakeLLMEngine
from tests.support.served_stack import Stack, served, tiny_engine
from tests.support.waiting import HANG_S, wait_for

# Tiny on purpose: the tests wait for the close, never for a duration.
TIMEOUT_S = 0.2
BODY = b'{"prompt": "Once upon a time", "max_tokens": 2}'


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    server = ServerConfig(
        host="127.0.0.1", http_port=0, header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S
    )
    with served(tiny_engine(tiny_llama_dir), server) as s:
        yield s


def _connect(s: Stack) -> socket.socket:
    sock = socket.create_connection((s.http.host, s.http.port), timeout=HANG_S)
    sock.settimeout(HANG_S)  # the hang guard: a server that never closes fails here
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _post_head(length: int) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(length).encode() + b"\r\n\r\n"
    )


def test_a_connection_that_sends_nothing_is_closed(stack) -> None:
    assert _read_until_closed(_connect(stack)) == b""


def test_a_connection_that_sends_half_its_headers_is_closed(stack) -> None:
    sock = _connect(stack)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Ty")
    assert _read_until_closed(sock) == b""


def test_a_kept_alive_connection_that_sends_half_the_next_headers_is_closed(stack) -> None:
    sock = _connect(stack)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n" + b"GET /health HTTP/1.1\r\nHo")
    answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1") == 1, answer


def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes(stack) -> None:
    sock = _connect(stack)
    sock.sendall(_post_head(len(BODY)) + BODY[: len(BODY) // 2])
    answer = _read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_whole_request_is_still_answered(stack) -> None:
    """The timeouts only cut what is late: a prompt client is served as before."""
    r = httpx.post(f"{stack.url}/v1/completions", content=BODY, timeout=HANG_S)
    assert r.status_code == 200, r.text


# ---- a client that leaves mid-upload ------------------------------------------------------------
def _responses(text: str, route: str) -> dict[str, float]:
    """appliance_http_responses_total for `route`, by status."""
    return {
        s.labels["status"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "appliance_http_responses_total" and s.labels.get("route") == route
    }


def test_a_client_that_leaves_mid_upload_counts_499_not_500(caplog) -> None:
    """In process, at the ASGI boundary: the body's first half, then `http.disconnect`."""
    caplog.set_level(logging.INFO)
    sent: list[dict] = []
    messages = [
        {"type": "http.request", "body": BODY[:10], "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def main() -> str:
        aeng = AsyncEngine(FakeLLMEngine())
        app = build_app(aeng, ServerConfig(), version="9.9.9")
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions",
            "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(BODY)).encode())],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        }  # fmt: skip
        try:
            await app(scope, receive, send)  # a 500 re-raises here (uvicorn logs it again)
        finally:
            await aeng.shutdown()
        return app.state.appliance.metrics.render()[0].decode()

    metrics = asyncio.run(asyncio.wait_for(main(), HANG_S))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499, sent
    assert _responses(metrics, "/v1/completions") == {"499": 1.0}
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


def test_a_served_client_that_leaves_mid_upload_counts_499(tiny_llama_dir) -> None:
    """Served, with the default body timeout (the disconnect, not a 408, ends the read)."""
    with served(tiny_engine(tiny_llama_dir)) as s:
        sock = _connect(s)
        sock.sendall(_post_head(len(BODY)) + BODY[:10])
        sock.close()

        def counted() -> dict[str, float]:
            return _responses(httpx.get(f"{s.url}/metrics").text, "/v1/completions")

        wait_for(lambda: bool(counted()), "the upload to be counted")
        assert counted() == {"499": 1.0}
