"""Tenants served over HTTP and gRPC on the real engine (tiny checkpoint, `fair` policy):
`max_queued` answers 429 `tenant_queue_full` for that tenant only while the other tenant is
admitted; `tokens_per_minute` answers 429 with Retry-After; `cache_salt_by_tenant` lets a
tenant's keys share cached blocks and keeps tenants apart; request metrics carry the
`tenant` label and the per-tenant gauges appear. The engine's steps are held by the step
gate wherever a request must still be waiting when the next one arrives.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import ServerConfig
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from tests.support.served_stack import Stack, served, tiny_engine, wait_idle_and_free
from tests.support.waiting import HANG_S, StepGate, wait_for

A1, A2, B, D = "key-a1", "key-a2", "key-b", "key-d"
BLOCK = 16
_prompts = itertools.count(1)


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    server = ServerConfig(
        host="127.0.0.1",
        http_port=0,
        api_keys=(D,),
        tenants={
            "a": {"keys": [A1, A2], "max_queued": 1},
            "b": {"keys": [B], "weight": 3, "tokens_per_minute": 400},
        },
        cache_salt_by_tenant=True,
    )
    llm = tiny_engine(tiny_llama_dir, block_size=BLOCK, max_model_len=512, policy="fair")
    with served(llm, server) as s:
        yield s


def _post(stack: Stack, key: str, **body) -> httpx.Response:
    body = {"prompt": "hello", "max_tokens": 2, **body}
    return httpx.post(
        f"{stack.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
        timeout=HANG_S,
    )  # fmt: skip


def _grpc_generate(stack: Stack, key: str) -> grpc.StatusCode:
    req = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=2))

    async def main() -> grpc.StatusCode:
        async with stack.grpc.channel() as ch:
            call = pb_grpc.ApplianceStub(ch).Generate(
                req, metadata=(("authorization", f"Bearer {key}"),)
            )
            try:
                [r async for r in call]
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

    return stack.grpc.run(main())


def test_max_queued_is_a_429_for_that_tenant_only(stack):
    with StepGate(stack.aeng.engine) as gate, ThreadPoolExecutor(2) as pool:
        first = pool.submit(_post, stack, A1)
        wait_for(lambda: stack.aeng.stats().num_waiting == 1, "a's first request queued")
        r = _post(stack, A2)  # the same tenant, its other key: a already has 1 waiting
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "tenant_queue_full" and "tenant 'a'" in err["message"]
        assert err["type"] == "rate_limit_error"
        assert _grpc_generate(stack, A1) is grpc.StatusCode.RESOURCE_EXHAUSTED
        other = pool.submit(_post, stack, D)  # the default tenant is admitted
        wait_for(lambda: stack.aeng.stats().num_waiting == 2, "the other tenant queued")
        gate.open()
        assert first.result(HANG_S).status_code == 200
        assert other.result(HANG_S).status_code == 200
    wait_idle_and_free(stack.aeng)


def test_tokens_per_minute_is_a_429_with_retry_after(stack):
    with StepGate(stack.aeng.engine) as gate, ThreadPoolExecutor(1) as pool:
        # b's bucket holds 400: this one reserves its prompt + 300.
        first = pool.submit(_post, stack, B, max_tokens=300, ignore_eos=True)
        wait_for(lambda: stack.aeng.stats().num_waiting == 1, "b's request queued")
        r = _post(stack, B, max_tokens=300)
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "tokens_per_minute_exceeded"
        # About (reservation - what is left) / (400 per minute): some tens of seconds.
        assert 10 <= int(r.headers["Retry-After"]) <= 60
        assert _post(stack, B, max_tokens=500).json()["error"]["param"] == "max_tokens"
        gate.open()
        assert first.result(HANG_S).status_code == 200
    wait_idle_and_free(stack.aeng)


def _cached(stack: Stack, key: str, prompt: list[int]) -> int:
    r = _post(stack, key, prompt=prompt, max_tokens=1)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_by_tenant_shares_within_a_tenant_only(stack):
    base = 10 + 3 * BLOCK * next(_prompts)
    prompt = list(range(base, base + 3 * BLOCK))
    assert _cached(stack, A1, prompt) == 0
    assert _cached(stack, B, prompt) == 0  # another tenant: no hit
    assert _cached(stack, D, prompt) == 0  # nor the default tenant
    assert _cached(stack, A2, prompt) >= 2 * BLOCK  # a's other key: a's blocks


def test_request_metrics_carry_the_tenant_and_per_tenant_gauges_appear(stack):
    assert _post(stack, A1).status_code == 200
    assert _post(stack, B).status_code == 200
    text = httpx.get(f"{stack.url}/metrics", timeout=HANG_S).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    finished = {
        s.labels["tenant"] for s in fams["appliance_requests_finished"].samples
        if s.name.endswith("_total")
    }  # fmt: skip
    assert {"a", "b"} <= finished
    ttft = {s.labels.get("tenant") for s in fams["appliance_time_to_first_token_seconds"].samples}
    assert {"a", "b"} <= ttft
    counters = {
        s.labels["tenant"]: s.value for s in fams["appliance_tenant_virtual_tokens"].samples
    }
    assert counters["a"] > 0 and counters["b"] > 0
    tokens = fams["appliance_tenant_tokens"].samples
    assert any(s.labels == {"tenant": "b", "kind": "generation"} and s.value > 0 for s in tokens)


def test_an_unknown_key_is_still_refused(stack):
    assert _post(stack, "key-nobody").status_code == 401
