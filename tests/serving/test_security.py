"""Security: keys on every generation route and rpc, compared in constant time; probes open;
size limits on bodies, headers and messages; prompts and outputs kept out of the logs;
CORS off unless configured.

Routes and rpcs are enumerated from the OpenAPI table and the proto descriptors, so a route
or method added later is covered without touching this file. (The container's non-root
user is pinned by test_containerfile.py.)
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc

from appliance.config import ServerConfig
from appliance.config.schema import LoRASection
from appliance.grpc.auth import EXEMPT_METHODS, ApiKeyInterceptor
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb
from appliance.grpc.proto.inference import grpc_service_pb2_grpc as kpb_grpc
from appliance.http.middleware import AuthMiddleware
from appliance.http.openapi import ROUTES
from tests.serving.test_bad_input_grpc import _kserve, _sp
from tests.support.served_stack import Stack, served, tiny_engine
from tests.support.waiting import HANG_S, wait_for

KEYS = ("sk-first-key", "sk-second-key")
GOOD = {"Authorization": f"Bearer {KEYS[1]}"}
SECRET = "zebra octopus seventeen"
BODY_LIMIT = 16 * 1024
HEADER_LIMIT = 4 * 1024
_BODIES: dict[str, dict] = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [5]},
    "/v1/completions/render": {"prompt": "hi"},
    "/v1/chat/completions/render": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/load_lora_adapter": {"lora_name": "x", "lora_path": "/etc"},
    "/v1/unload_lora_adapter": {"lora_name": "x"},
    "/v1/responses": {"input": "hi", "max_output_tokens": 16, "store": False},
    "/v1/responses/input_tokens": {"input": "hi"},
    "/v1/embeddings": {"input": "hi"},
}
# What a good key gets from the adapter routes (runtime updates on, nothing loaded): a path
# outside lora.allowed_dirs, an adapter that is not there.
# A stored response that is not there; embeddings from a generation model (a 400 naming its
# task).
_GOOD_STATUS = {
    "/v1/load_lora_adapter": 403,
    "/v1/unload_lora_adapter": 404,
    "/v1/responses/{response_id}": 404,
    "/v1/responses/{response_id}/cancel": 404,
    "/v1/responses/{response_id}/input_items": 404,
    "/v1/embeddings": 400,
}


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    server = ServerConfig(
        host="127.0.0.1", api_keys=KEYS, max_request_body=BODY_LIMIT, max_header_bytes=HEADER_LIMIT
    )
    # Runtime adapter loading on, so its routes read their bodies (and must be guarded).
    lora = LoRASection(
        enabled=True,
        allow_runtime_updates=True,
        allowed_dirs=(str(tmp_path_factory.mktemp("adapters")),),
    )
    with served(tiny_engine(tiny_llama_dir), server, lora=lora) as s:
        yield s


def _route_path(path: str) -> str:
    return path.replace("{model}", "tiny").replace("{response_id}", "resp_missing")


# ---- HTTP keys ---------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r.method} {r.path}")
def test_every_documented_route_is_guarded_exactly_as_documented(stack, route) -> None:
    url, path = stack.url, _route_path(route.path)
    body = _BODIES.get(route.path)
    kw: dict[str, Any] = {"json": body} if body is not None else {}
    no_key = httpx.request(route.method, f"{url}{path}", **kw)
    wrong = httpx.request(
        route.method, f"{url}{path}", headers={"Authorization": "Bearer sk-no"}, **kw
    )
    basic = httpx.request(
        route.method, f"{url}{path}", headers={"Authorization": f"Basic {KEYS[0]}"}, **kw
    )
    good = httpx.request(route.method, f"{url}{path}", headers=GOOD, timeout=HANG_S, **kw)
    if route.auth:
        for r in (no_key, wrong, basic):
            assert r.status_code == 401, (path, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    else:  # probes and metrics: orchestrators and scrapers carry no key
        assert no_key.status_code == 200, (path, no_key.text)
    assert good.status_code == _GOOD_STATUS.get(route.path, 200), (path, good.text)


@pytest.mark.parametrize(
    "path", ["/v1/completions/", "//v1/completions", "/v1/./completions", "/v1%2Fcompletions",
             "/v1/models/tiny/", "/tokenize/", "/v1", "/v1/"],
)  # fmt: skip
def test_path_variants_never_reach_a_generation_route_without_a_key(stack, path) -> None:
    r = httpx.post(f"{stack.url}{path}", json=_BODIES["/v1/completions"], follow_redirects=False)
    assert r.status_code in (401, 404, 405, 307), (path, r.status_code, r.text)
    if r.status_code == 307:  # Starlette's slash redirect: it leads to a guarded path
        r = httpx.post(f"{stack.url}{r.headers['location'].split(stack.url)[-1]}",
                       json=_BODIES["/v1/completions"])  # fmt: skip
        assert r.status_code == 401, (path, r.status_code)


# ---- gRPC keys ---------------------------------------------------------------------------------
def _methods() -> list[tuple[str, Any]]:
    out = []
    for fd, name in ((pb.DESCRIPTOR, "Appliance"), (kpb.DESCRIPTOR, "GRPCInferenceService")):
        service = fd.services_by_name[name]
        out += [(f"/{service.full_name}/{m.name}", m) for m in service.methods]
    return out


async def _call(ch: grpc.aio.Channel, path: str, method: Any, metadata: Any) -> grpc.StatusCode:
    request = message_factory.GetMessageClass(method.input_type)()
    kw = {"request_serializer": type(request).SerializeToString,
          "response_deserializer": message_factory.GetMessageClass(method.output_type).FromString}  # fmt: skip
    try:
        if method.client_streaming:
            call = ch.stream_stream(path, **kw)(iter([]), metadata=metadata, timeout=HANG_S)
        elif method.server_streaming:
            call = ch.unary_stream(path, **kw)(request, metadata=metadata, timeout=HANG_S)
        else:
            await ch.unary_unary(path, **kw)(request, metadata=metadata, timeout=HANG_S)
            return grpc.StatusCode.OK
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("path, method", _methods(), ids=[p for p, _ in _methods()])
def test_every_rpc_needs_a_key_except_the_probes(stack, path, method) -> None:
    async def main() -> tuple:
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            return (
                await _call(ch, path, method, None),
                await _call(ch, path, method, (("authorization", "Bearer sk-no"),)),
                await _call(ch, path, method, (("authorization", f"Bearer {KEYS[0]}"),)),
            )

    none, wrong, good = stack.run(main())
    unauth = grpc.StatusCode.UNAUTHENTICATED
    if path in EXEMPT_METHODS:
        assert none == wrong == grpc.StatusCode.OK
    else:
        assert none == wrong == unauth, (none, wrong)
    assert good != unauth  # an empty request may be refused, but not for its credentials


def test_grpc_health_needs_no_key(stack) -> None:
    async def main() -> int:
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            return r.status

    assert stack.run(main()) == health_pb2.HealthCheckResponse.SERVING


# ---- constant-time comparison -------------------------------------------------------------------
@pytest.mark.parametrize("token", [KEYS[0], KEYS[1], "sk-wrong", "", "x" * 1000])
def test_every_key_is_compared_with_compare_digest_and_no_early_exit(monkeypatch, token) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    keys = [*KEYS, "sk-third"]
    http_ok = AuthMiddleware(app=None, api_keys=keys)._valid(token)  # type: ignore[arg-type]
    assert http_ok == (token in keys) and len(calls) == len(keys)
    calls.clear()
    grpc_ok = ApiKeyInterceptor(keys).authorized([("authorization", f"Bearer {token}")])
    assert grpc_ok == (token in keys)
    assert len(calls) == (len(keys) if token else 0)  # an empty token is no token at all


# ---- size limits -------------------------------------------------------------------------------
@pytest.mark.parametrize("path", list(_BODIES))
def test_every_post_route_caps_its_body_even_when_chunked(stack, path) -> None:
    def chunked() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(f"{stack.url}{path}", content=chunked(),
                   headers={**GOOD, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_headers_are_capped_before_the_key_is_checked(stack) -> None:
    headers = {f"x-pad-{i}": "y" * 200 for i in range(HEADER_LIMIT // 200 + 2)}
    r = httpx.post(f"{stack.url}/v1/completions", json=_BODIES["/v1/completions"], headers=headers)
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"


def test_grpc_messages_are_capped_at_the_body_limit(stack) -> None:
    async def main() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            stub = pb_grpc.ApplianceStub(ch)
            md = (("authorization", f"Bearer {KEYS[0]}"),)
            try:
                await stub.Tokenize(pb.TokenizeRequest(text="x" * (BODY_LIMIT + 1)), metadata=md)
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

    assert stack.run(main()) == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---- logs ------------------------------------------------------------------------------------
def _every_record_text(records: list[logging.LogRecord]) -> str:
    parts = []
    for r in records:
        parts += [r.getMessage(), json.dumps(getattr(r, "fields", None), default=str)]
        if r.exc_info:
            parts.append(logging.Formatter().formatException(r.exc_info))
    return "\n".join(parts)


def _count(records: list[logging.LogRecord], msg: str) -> int:
    return sum(r.getMessage() == msg for r in list(records))


HTTP_REQUESTS_IN_TRAFFIC = 6


def _traffic(s: Stack, headers: dict[str, str]) -> list[str]:
    """Every kind of request, each carrying SECRET; returns the texts the server generated."""
    outputs = []
    with httpx.Client(base_url=s.url, headers=headers, timeout=HANG_S) as c:
        r = c.post("/v1/completions", json={"prompt": SECRET, "max_tokens": 12, "ignore_eos": True})
        outputs.append(r.json()["choices"][0]["text"])
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": SECRET}],
                                                 "max_tokens": 12, "ignore_eos": True})  # fmt: skip
        outputs.append(r.json()["choices"][0]["message"]["content"])
        with c.stream("POST", "/v1/completions", json={"prompt": SECRET, "stream": True}) as r:
            r.read()
        c.post("/tokenize", json={"prompt": SECRET})
        assert (
            c.post("/v1/completions", json={"prompt": SECRET, "temperature": -1}).status_code == 400
        )
        assert (
            c.post("/v1/completions", json={"prompt": SECRET, "stop": [SECRET] * 17}).status_code
            == 400
        )

    async def grpc_traffic() -> None:
        md = tuple((k.lower(), v) for k, v in headers.items())
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            stub = pb_grpc.ApplianceStub(ch)
            req = pb.GenerateRequest(text=SECRET, sampling=pb.SamplingParams(max_tokens=12,
                                                                              ignore_eos=True))  # fmt: skip
            outputs.append("".join([r.text async for r in stub.Generate(req, metadata=md)]))
            await stub.Tokenize(pb.TokenizeRequest(text=SECRET), metadata=md)
            kstub = kpb_grpc.GRPCInferenceServiceStub(ch)
            await kstub.ModelInfer(_kserve(text=SECRET.encode(), sampling=_sp(max_tokens=4)),
                                   metadata=md)  # fmt: skip
            bad = pb.GenerateRequest(text=SECRET, sampling=pb.SamplingParams(temperature=-1))
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in stub.Generate(bad, metadata=md):
                    pass

    s.run(grpc_traffic())
    return [o for o in outputs if len(o.strip()) >= 12]  # long enough not to match by chance


def test_prompts_and_outputs_stay_out_of_the_logs_by_default(stack, caplog) -> None:
    with caplog.at_level(logging.DEBUG):
        outputs = _traffic(stack, GOOD)
        # The access line of each HTTP request is written once its response is done, which
        # may be after the client has read it: wait for all of them, not for a while.
        wait_for(lambda: _count(caplog.records, "http request") >= HTTP_REQUESTS_IN_TRAFFIC,
                 "every HTTP request logged")  # fmt: skip
    text = _every_record_text(caplog.records)
    assert "completion done" in text  # the lines exist; they just carry no content
    assert SECRET not in text
    assert outputs and not [o for o in outputs if o in text]


def test_log_prompts_puts_them_in(tiny_llama_dir, caplog) -> None:
    server = ServerConfig(host="127.0.0.1", log_prompts=True)
    with served(tiny_engine(tiny_llama_dir), server) as s, caplog.at_level(logging.INFO):
        httpx.post(f"{s.url}/v1/completions", json={"prompt": SECRET, "max_tokens": 2})
    assert SECRET in _every_record_text(caplog.records)


# ---- CORS --------------------------------------------------------------------------------------
def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(
        f"{url}/v1/completions",
        headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"},
    )  # fmt: skip


def test_cors_is_off_unless_configured_and_then_only_for_those_origins(
    stack, tiny_llama_dir
) -> None:
    r = _preflight(stack.url, "https://evil.example")
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{stack.url}/v1/models", headers={**GOOD, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    server = ServerConfig(host="127.0.0.1", api_keys=KEYS, cors_origins=("https://ui.example",))
    with served(tiny_engine(tiny_llama_dir), server) as s:
        ok = _preflight(s.url, "https://ui.example")
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://ui.example"
        evil = _preflight(s.url, "https://evil.example")
        assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
        r = httpx.post(f"{s.url}/v1/completions", json=_BODIES["/v1/completions"],
                       headers={"Origin": "https://ui.example"})  # fmt: skip
        assert r.status_code == 401  # CORS lets the browser ask; the key still decides
