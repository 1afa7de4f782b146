"""HTTP API mechanics in-process (httpx.ASGITransport) over a fake engine.

Status codes and OpenAI error bodies for transport-level failures (JSON, content type,
body size, routes, methods, auth), queue-full, failed and dead engines, the OpenAPI
document, SSE framing and /metrics. The model-dependent behaviour is in
test_http_openai.py against a real server on the tiny checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import ServerConfig
from appliance.http.app import ENDPOINTS, build_app
from appliance.http.openapi import build_openapi
from engine.async_engine import AsyncEngine
from engine.worker.status import AcceleratorStatus
from tests.support.fake_engine import FakeLLMEngine
from tests.support.waiting import HANG_S, StepGate, wait_for, wait_for_async

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_S))


async def _with_client(fn, server: ServerConfig | None = None, **fake_kw):
    dead_after = fake_kw.pop("dead_after", 3)
    fake = FakeLLMEngine(**fake_kw)
    aeng = AsyncEngine(fake, max_consecutive_failures=dead_after)
    app = build_app(aeng, server or ServerConfig(), version="9.9.9")
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await fn(c, fake, aeng)
    finally:
        await aeng.shutdown()


def _assert_error(r: httpx.Response, status: int, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_completion_and_chat_answer_in_openai_shape():
    async def fn(c, fake, aeng):
        r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "fake-model"
        assert (
            body["choices"][0]["text"] == "fgh" and body["choices"][0]["finish_reason"] == "length"
        )
        assert body["usage"] == {
            "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 0},
        }  # fmt: skip
        r = await c.post("/v1/chat/completions", json={**CHAT, "n": 2})
        body = r.json()
        assert body["object"] == "chat.completion"
        assert [ch["index"] for ch in body["choices"]] == [0, 1]
        assert body["choices"][0]["message"]["role"] == "assistant"

    run(_with_client(fn))


def test_batched_prompts_number_choices_prompt_major():
    async def fn(c, fake, aeng):
        r = await c.post("/v1/completions", json={"prompt": ["a", "bb"], "max_tokens": 2, "n": 2})
        choices = r.json()["choices"]
        assert [ch["index"] for ch in choices] == [0, 1, 2, 3]
        assert [ch["text"] for ch in choices] == ["bc", "cd", "cd", "de"]

    run(_with_client(fn))


def test_chat_stream_is_sse_with_role_first_usage_last_and_done():
    async def fn(c, fake, aeng):
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = (await r.aread()).decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks[1:-1])
        assert text == "uvw"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert all("usage" in ch and ch["usage"] is None for ch in chunks[:-1])

    run(_with_client(fn))


BAD_TRANSPORT = [
    # (description, path, kwargs, status, param, code)
    ("malformed json", "/v1/completions", {"content": b"{", "headers": {"content-type": "application/json"}}, 400, None, "invalid_json"),
    ("json not an object", "/v1/completions", {"json": [1]}, 400, None, "invalid_json"),
    ("wrong content type", "/v1/completions", {"content": b"prompt=x", "headers": {"content-type": "application/x-www-form-urlencoded"}}, 415, None, "unsupported_media_type"),
    ("missing prompt", "/v1/completions", {"json": {}}, 400, "prompt", "missing_required_parameter"),
    ("unknown field", "/v1/completions", {"json": {"prompt": "x", "bogus": 1}}, 400, "bogus", "unknown_parameter"),
    ("string for int", "/v1/completions", {"json": {"prompt": "x", "max_tokens": "5"}}, 400, "max_tokens", "invalid_type"),
    ("max_tokens 0", "/v1/completions", {"json": {"prompt": "x", "max_tokens": 0}}, 400, "max_tokens", None),
    ("temperature > 2", "/v1/chat/completions", {"json": {**CHAT, "temperature": 3}}, 400, "temperature", None),
    ("nested type", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": 5}]}}, 400, "messages.0.content", None),
    ("bad role", "/v1/chat/completions", {"json": {"messages": [{"role": "wizard", "content": "x"}]}}, 400, "messages.0.role", None),
    ("empty messages", "/v1/chat/completions", {"json": {"messages": []}}, 400, "messages", None),
    ("image part", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}}, 400, "messages.0.content.0.type", "unsupported_parameter"),
    ("tools", "/v1/chat/completions", {"json": {**CHAT, "tools": [{"type": "function"}]}}, 400, "tools.0", "missing_required_parameter"),
    ("unknown response_format type", "/v1/chat/completions", {"json": {**CHAT, "response_format": {"type": "yaml"}}}, 400, "response_format.type", None),
    ("unknown model", "/v1/completions", {"json": {"prompt": "x", "model": "gpt-9"}}, 404, "model", "model_not_found"),
    ("bad logit_bias key", "/v1/completions", {"json": {"prompt": "x", "logit_bias": {"abc": 1}}}, 400, "logit_bias", None),
    ("logit_bias out of range", "/v1/completions", {"json": {"prompt": "x", "logit_bias": {"5": 500}}}, 400, "logit_bias", None),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"json": {**CHAT, "top_logprobs": 2}}, 400, "top_logprobs", None),
    ("stream_options without stream", "/v1/chat/completions", {"json": {**CHAT, "stream_options": {"include_usage": True}}}, 400, "stream_options", None),
    ("best_of", "/v1/completions", {"json": {"prompt": "x", "best_of": 3}}, 400, "best_of", "unsupported_parameter"),
    ("empty prompt list", "/v1/completions", {"json": {"prompt": []}}, 400, "prompt", None),
    ("tokenize both", "/tokenize", {"json": {"prompt": "x", "messages": CHAT["messages"]}}, 400, "prompt", None),
    ("detokenize bad id", "/detokenize", {"json": {"tokens": [99999]}}, 400, "tokens", None),
]  # fmt: skip


@pytest.mark.parametrize(
    "path, kwargs, status, param, code",
    [case[1:] for case in BAD_TRANSPORT],
    ids=[case[0] for case in BAD_TRANSPORT],
)
def test_bad_input_gets_a_4xx_openai_error_naming_the_field(path, kwargs, status, param, code):
    async def fn(c, fake, aeng):
        _assert_error(await c.post(path, **kwargs), status, param, code)

    run(_with_client(fn))


def test_harmless_openai_fields_are_accepted():
    async def fn(c, fake, aeng):
        body = {**CHAT, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                "user": "u1", "store": False, "metadata": {"a": "b"}}  # fmt: skip
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200

    run(_with_client(fn))


def test_unknown_route_and_wrong_method_are_openai_errors():
    async def fn(c, fake, aeng):
        _assert_error(await c.get("/v1/nothing"), 404, None, "not_found")
        _assert_error(await c.get("/v1/completions"), 405, None, "method_not_allowed")
        _assert_error(await c.get("/v1/models/other"), 404, "model", "model_not_found")

    run(_with_client(fn))


def test_oversized_body_is_413_by_header_and_by_bytes_received():
    async def fn(c, fake, aeng):
        big = json.dumps({"prompt": "x" * 5000}).encode()
        _assert_error(await c.post("/v1/completions", content=big), 413, None, "request_too_large")

        async def chunked():  # no Content-Length: the limit must hold on the stream itself
            for _ in range(10):
                yield b" " * 1000

        r = await c.post(
            "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
        )
        _assert_error(r, 413, None, "request_too_large")
        assert (
            await c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1})
        ).status_code == 200

    run(_with_client(fn, ServerConfig(max_request_body=4096)))


def test_api_keys_guard_v1_and_tokenizer_routes_but_not_probes():
    async def fn(c, fake, aeng):
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/tokenize"), ("POST", "/detokenize")]:  # fmt: skip
            _assert_error(await c.request(method, path, json={}), 401, None, "invalid_api_key")
            bad = {"Authorization": "Bearer wrong"}
            _assert_error(await c.request(method, path, json={}, headers=bad), 401)
        ok = {"Authorization": "Bearer k2"}
        assert (await c.get("/v1/models", headers=ok)).status_code == 200
        r = await c.post("/tokenize", json={"prompt": "ab"}, headers=ok)
        assert r.json()["tokens"] == [97, 98]
        for path in ("/health", "/ready", "/metrics", "/version", "/openapi.json"):
            assert (await c.get(path)).status_code == 200, path

    run(_with_client(fn, ServerConfig(api_keys=("k1", "k2"))))


def test_queue_full_is_429_and_running_requests_finish():
    async def fn(c, fake, aeng):
        gate = StepGate(fake, permits=1)  # "a" is admitted, then steps are held
        running = asyncio.create_task(
            c.post("/v1/completions", json={"prompt": "a", "max_tokens": 30})
        )
        await wait_for_async(lambda: gate.steps == 1, "the first request running")
        waiting = asyncio.create_task(
            c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
        )
        await wait_for_async(lambda: fake.stats().num_waiting == 1, "the second request queued")
        r = await c.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})
        err = _assert_error(r, 429, None, "queue_full")
        assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
        gate.open()
        assert (await running).status_code == 200 and (await waiting).status_code == 200

    run(_with_client(fn, max_num_seqs=1, max_queue_len=1))


def test_a_failed_step_is_a_500_and_the_next_request_succeeds():
    async def fn(c, fake, aeng):
        fake.fail_steps = 1
        _assert_error(await c.post("/v1/chat/completions", json=CHAT), 500, None, "engine_error")
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        fake.fail_steps = 1
        async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            raw = (await r.aread()).decode()
        assert '"code": "engine_error"' in raw and raw.endswith("data: [DONE]\n\n")
        assert (await c.get("/health")).status_code == 200

    run(_with_client(fn))


def test_dead_engine_is_503_on_requests_and_health():
    async def fn(c, fake, aeng):
        fake.fail_steps = 100
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code in (500, 503)
        _assert_error(
            await c.post("/v1/chat/completions", json=CHAT), 503, None, "engine_unavailable"
        )
        _assert_error(await c.get("/health"), 503)
        _assert_error(await c.get("/ready"), 503)

    run(_with_client(fn, dead_after=1))


def test_openapi_documents_exactly_the_mounted_routes_with_the_request_models():
    doc = build_openapi("1.0")
    assert doc["openapi"].startswith("3.1")
    mounted = {(m, p) for m, p in ENDPOINTS}
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == mounted
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False
    assert {"messages", "max_completion_tokens", "top_k", "priority"} <= set(chat["properties"])
    ref = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert ref["schema"]["$ref"] == "#/components/schemas/CompletionRequest"


def test_metrics_parse_and_count_requests_by_outcome():
    async def fn(c, fake, aeng):
        for _ in range(2):
            await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        text = (await c.get("/metrics")).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        outcome = [
            s for s in fams["appliance_requests_finished"].samples if s.name.endswith("_total")
        ]
        assert outcome[0].labels == {"finish_reason": "length", "tenant": "default"}
        assert outcome[0].value == 2
        for name in ("appliance_time_to_first_token_seconds", "appliance_e2e_request_latency_seconds",
                     "appliance_time_per_output_token_seconds", "appliance_request_queue_time_seconds"):  # fmt: skip
            count = [s for s in fams[name].samples if s.name.endswith("_count")]
            assert count[0].value == 2, name
        for name in ("appliance_requests_running", "appliance_requests_waiting",
                     "appliance_kv_cache_usage_ratio", "appliance_prefix_cache_queries",
                     "appliance_prefix_cache_hits", "appliance_preemptions",
                     "appliance_prompt_tokens", "appliance_generation_tokens"):  # fmt: skip
            assert name in fams, name
        gen = fams["appliance_generation_tokens"].samples[0].value
        assert gen == 4
        http = fams["appliance_http_responses"].samples
        assert any(s.labels == {"route": "/v1/completions", "status": "200"} for s in http)

    run(_with_client(fn))


def test_metrics_carry_vllm_names_for_kv_aware_gateways_beside_ours():
    """vllm:num_requests_running / _waiting and vllm:kv_cache_usage_perc (a 0..1 fraction),
    labelled model_name as vLLM labels them, equal to our own gauges from the same snapshot."""

    async def fn(c, fake, aeng):
        gate = StepGate(fake, permits=1)  # the first request is admitted, then steps hold
        body = {"prompt": "x", "max_tokens": 3}
        first = asyncio.create_task(c.post("/v1/completions", json=body))
        await wait_for_async(lambda: aeng.stats().num_running == 1, "first request running")
        second = asyncio.create_task(c.post("/v1/completions", json=body))
        # the engine loop's snapshot (what /metrics reads), not the fake's live state
        await wait_for_async(lambda: aeng.stats().num_waiting == 1, "second request waiting")
        fams = {f.name: f for f in text_string_to_metric_families((await c.get("/metrics")).text)}
        gate.open()
        assert [(await t).status_code for t in (first, second)] == [200, 200]
        return fams

    fams = run(_with_client(fn, max_num_seqs=1))
    ours = {
        "vllm:num_requests_running": "appliance_requests_running",
        "vllm:num_requests_waiting": "appliance_requests_waiting",
        "vllm:kv_cache_usage_perc": "appliance_kv_cache_usage_ratio",
    }
    for vllm_name, our_name in ours.items():
        fam = fams[vllm_name]
        assert fam.type == "gauge", vllm_name
        [sample] = fam.samples
        assert sample.labels == {"model_name": "fake-model"}, sample
        assert sample.value == fams[our_name].samples[0].value, vllm_name
    assert fams["vllm:num_requests_running"].samples[0].value == 1
    assert fams["vllm:num_requests_waiting"].samples[0].value == 1
    assert fams["vllm:kv_cache_usage_perc"].samples[0].value == 0.01  # the fake: running / 100


def test_disconnect_while_queued_aborts_streamed_and_non_streamed_requests():
    """Over real uvicorn: a client that leaves before its first token still frees its slot."""
    import threading

    from appliance.http.server import BackgroundServer

    fake = FakeLLMEngine(max_num_seqs=1)
    aeng = AsyncEngine(fake)
    gate = StepGate(fake, permits=1)  # the hog is admitted, then held: the others must queue
    try:
        with BackgroundServer(build_app(aeng)) as srv:
            hog = threading.Thread(
                target=lambda: httpx.post(
                    f"{srv.url}/v1/completions",
                    json={"prompt": "a", "max_tokens": 100},
                    timeout=HANG_S,
                )
            )
            hog.start()
            gate.wait_steps(1)
            body = {"prompt": "b", "max_tokens": 5, "stream": True}
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=HANG_S) as r:
                assert r.status_code == 200 and fake.stats().num_waiting == 1
            wait_for(lambda: len(fake.aborted) == 1 and fake.stats().num_waiting == 0,
                     "the streamed request aborted")  # fmt: skip
            # A non-streamed request whose client leaves while it waits in the queue.
            with _raw_post(srv.url, "/v1/completions", {"prompt": "c"}):
                wait_for(lambda: fake.stats().num_waiting == 1, "the request queued")
            wait_for(lambda: len(fake.aborted) == 2 and fake.stats().num_waiting == 0,
                     "the non-streamed request aborted")  # fmt: skip
            gate.open()
            hog.join(HANG_S)
            assert not hog.is_alive()
    finally:
        run(aeng.shutdown())


@contextmanager
def _raw_post(url: str, path: str, body: dict) -> Iterator[socket.socket]:
    """Sends a POST on a raw socket and closes it on leaving, unanswered: a client that
    went away."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + data)
        yield sock


def test_cors_is_off_unless_configured():
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}

    async def off(c, fake, aeng):
        r = await c.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers

    async def on(c, fake, aeng):
        r = await c.options("/v1/completions", headers=preflight)
        assert r.status_code == 200  # a preflight needs no API key
        assert r.headers["access-control-allow-origin"] == "https://ui.example"

    run(_with_client(off))
    run(_with_client(on, ServerConfig(cors_origins=("https://ui.example",), api_keys=("k",))))


@pytest.mark.parametrize("log_prompts", [False, True])
def test_prompts_reach_the_logs_only_with_log_prompts(caplog, log_prompts):
    async def fn(c, fake, aeng):
        with caplog.at_level("INFO"):
            await c.post("/v1/completions", json={"prompt": "secret words", "max_tokens": 2})
            await c.post(
                "/v1/chat/completions",
                json={**CHAT, "messages": [{"role": "user", "content": "secret chat"}]},
            )

    run(_with_client(fn, ServerConfig(log_prompts=log_prompts)))
    logged = json.dumps([getattr(r, "fields", None) for r in caplog.records], default=str)
    assert ("secret words" in logged and "secret chat" in logged) == log_prompts
    assert "completion done" in caplog.text


def test_health_and_metrics_show_the_attention_backend_and_each_fallback_reason():
    async def fn(c, fake, aeng):
        fake.accelerator = AcceleratorStatus("flashinfer", decode_graphs=True)
        body = (await c.get("/health")).json()
        assert body == {"status": "ok", "attention_backend": "flashinfer",
                        "attention_fallback_reason": None, "decode_graphs": True,
                        "graphs_fallback_reason": None}  # fmt: skip
        fams = {f.name: f for f in text_string_to_metric_families((await c.get("/metrics")).text)}
        assert [s.labels for s in fams["appliance_attention_backend_info"].samples] == [
            {"backend": "flashinfer"}
        ]
        assert fams["appliance_accelerator_fallback"].samples == []

        fake.accelerator = AcceleratorStatus(
            "torch", "RuntimeError: ninja build failed", False, "RuntimeError: capture failed"
        )
        body = (await c.get("/health")).json()
        assert body["attention_backend"] == "torch"
        assert body["attention_fallback_reason"] == "RuntimeError: ninja build failed"
        assert body["graphs_fallback_reason"] == "RuntimeError: capture failed"
        fams = {f.name: f for f in text_string_to_metric_families((await c.get("/metrics")).text)}
        fallback = {s.labels["component"]: (s.labels["reason"], s.value)
                    for s in fams["appliance_accelerator_fallback"].samples}  # fmt: skip
        assert fallback == {
            "attention": ("RuntimeError: ninja build failed", 1.0),
            "decode_graphs": ("RuntimeError: capture failed", 1.0),
        }

    run(_with_client(fn))
