"""500 concurrent streaming requests, HTTP and gRPC mixed, against a small queue.

Every request either streams to a clean finish or is refused cleanly (HTTP 429 with an
OpenAI `queue_full` error, gRPC RESOURCE_EXHAUSTED), none hangs, and afterwards every KV
block is back in the pool and the running / waiting / in-flight gauges on /metrics read 0.
The engine's steps are held until the queue has overflowed once (the tiny model would
otherwise drain it as fast as a fast box fills it), then run freely for the rest of the
storm; a few tokens per request keep it to seconds on two cores.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from tests.support.served_stack import Stack, gauges, served, tiny_engine, wait_idle_and_free
from tests.support.waiting import HANG_S, StepGate

NUM_REQUESTS = 500
MAX_QUEUE_LEN = 32
PROMPTS = ["The quick brown fox", "Once upon a time", "What is the capital of France?"]


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    llm = tiny_engine(tiny_llama_dir, max_num_seqs=32, max_queue_len=MAX_QUEUE_LEN)
    with served(llm) as s:
        yield s


async def _http_stream(c: httpx.AsyncClient, i: int, rng: random.Random, gate: StepGate) -> str:
    max_tokens = rng.randint(2, 8)
    if i % 2:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
    else:
        path, body = "/v1/completions", {"prompt": rng.choice(PROMPTS)}
    body.update(max_tokens=max_tokens, stream=True, ignore_eos=True)
    async with c.stream("POST", path, json=body) as r:
        raw = (await r.aread()).decode()
    if r.status_code == 429:
        gate.open()
        err = json.loads(raw)["error"]
        assert err["code"] == "queue_full" and r.headers["retry-after"], raw
        return "refused"
    assert r.status_code == 200, raw
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]", raw
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in ch for ch in chunks), raw
    reasons = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert reasons == ["length"], raw
    return "ok"


async def _grpc_stream(stub: pb_grpc.ApplianceStub, rng: random.Random, gate: StepGate) -> str:
    max_tokens = rng.randint(2, 8)
    req = pb.GenerateRequest(
        text=rng.choice(PROMPTS), sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    try:
        responses = [r async for r in stub.Generate(req)]
    except grpc.aio.AioRpcError as e:
        gate.open()
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
        assert "queue is full" in (e.details() or "")
        return "refused"
    assert responses[-1].finish_reason == "length"
    assert responses[-1].usage.completion_tokens == max_tokens
    return "ok"


def test_500_concurrent_streams_finish_or_are_refused_and_leave_nothing_behind(stack) -> None:
    rng = random.Random(0)
    # Held until the first refusal: until then every accepted request waits, so the queue
    # surely overflows, and the MAX_QUEUE_LEN requests it holds surely finish.
    gate = StepGate(stack.aeng.engine)

    async def main() -> Counter:
        limits = httpx.Limits(max_connections=NUM_REQUESTS)
        async with (
            httpx.AsyncClient(base_url=stack.url, timeout=HANG_S, limits=limits) as c,
            grpc.aio.insecure_channel(stack.grpc_address) as ch,
        ):
            stub = pb_grpc.ApplianceStub(ch)
            calls = [
                _http_stream(c, i, random.Random(rng.random()), gate) if i % 2 else
                _grpc_stream(stub, random.Random(rng.random()), gate)
                for i in range(NUM_REQUESTS)
            ]  # fmt: skip
            results = await asyncio.wait_for(asyncio.gather(*calls), HANG_S)  # none hangs
        return Counter(results)

    try:
        outcomes = stack.run(main(), timeout=HANG_S + 30)
    finally:
        gate.remove()
    print(f"load: {NUM_REQUESTS} sent, outcomes {dict(outcomes)}")  # docs/reliability.md
    assert sum(outcomes.values()) == NUM_REQUESTS
    assert set(outcomes) == {"ok", "refused"}, outcomes  # both happened, nothing else did
    assert outcomes["ok"] >= MAX_QUEUE_LEN, outcomes
    wait_idle_and_free(stack.aeng)
    g = gauges(stack.url)
    assert g["appliance_requests_running"] == g["appliance_requests_waiting"] == 0, g
    assert g["appliance_requests_in_flight"] == 0, g
    assert g["appliance_kv_cache_free_blocks"] == g["appliance_kv_cache_blocks"], g
    # The server still serves after the storm.
    r = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
