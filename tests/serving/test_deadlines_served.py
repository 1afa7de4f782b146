"""Per-request deadlines, served, on the real engine (tiny checkpoint) held by the step gate:
a request whose deadline passes in the queue never gets a step and is answered 504 (OpenAI
error shape, `deadline_exceeded`); one whose deadline passes while it streams is stopped
at the next step, its blocks freed, and its stream ends with an error event;
`server.default_request_timeout_s` applies when the request sets none; a timeout header
that is not a positive finite number is a 400 naming it; gRPC (native and KServe) answers
DEADLINE_EXCEEDED, and a bad KServe `timeout` is INVALID_ARGUMENT. The deadline passes when
the test moves the scheduler's clock (`SkewedClock`), never by waiting.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from appliance.config import ServerConfig
from appliance.grpc.kserve_tensors import encode_bytes
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb
from appliance.grpc.proto.inference import grpc_service_pb2_grpc as kpb_grpc
from appliance.http.app import build_app
from appliance.http.server import BackgroundServer
from appliance.tenancy import Tenancy
from tests.support.grpc_harness import Harness, start_harness, tiny_llm_engine
from tests.support.skewed_clock import SkewedClock
from tests.support.waiting import HANG_S, StepGate, wait_for

BODY = {"prompt": "hello there", "max_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def harness(tiny_llama_dir) -> Iterator[Harness]:
    h = start_harness(tiny_llm_engine(tiny_llama_dir, max_num_seqs=4))
    yield h
    h.close()


@pytest.fixture
def held(harness) -> Iterator[tuple[StepGate, SkewedClock]]:
    """The engine with its steps held and its clock under the test's control."""
    llm = harness.engine.engine
    with StepGate(llm) as gate, SkewedClock().install(llm) as clock:
        yield gate, clock
    _wait_idle(harness)


def _wait_idle(h: Harness) -> None:
    def idle() -> bool:
        s = h.engine.stats()
        return h.engine.num_in_flight == 0 and s.num_running == 0 and s.num_waiting == 0

    wait_for(idle, "engine idle")


def _record_steps(h: Harness, monkeypatch) -> list:
    """Every SchedulerOutput the runner gets from now on."""
    runner = h.engine.engine.runner
    seen: list = []
    execute = runner.execute

    def spy(so):
        seen.append(so)
        return execute(so)

    monkeypatch.setattr(runner, "execute", spy)
    return seen


@pytest.fixture
def http(harness) -> Iterator[str]:
    server = ServerConfig(default_request_timeout_s=None)
    with BackgroundServer(build_app(harness.engine, server)) as srv:
        yield srv.url


def test_deadline_passing_in_the_queue_is_a_504_before_any_compute(
    harness, held, http, monkeypatch
):
    gate, clock = held
    seen = _record_steps(harness, monkeypatch)
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=HANG_S) as c:
        fut = pool.submit(
            c.post, f"{http}/v1/completions", json=BODY, headers={"X-Request-Timeout": "30"}
        )
        wait_for(lambda: harness.engine.stats().num_waiting == 1, "request queued")
        clock.jump(60)
        gate.allow(1)
        r = fut.result(HANG_S)
    assert r.status_code == 504
    err = r.json()["error"]
    assert err["code"] == "deadline_exceeded" and err["type"] == "timeout_error"
    assert "waited in the queue" in err["message"] and set(err) == {
        "message",
        "type",
        "param",
        "code",
    }
    assert all(not so.num_scheduled_tokens for so in seen)  # not one token computed
    metrics = httpx.get(f"{http}/metrics").text
    assert 'appliance_requests_expired_total{stage="queue",tenant="default"} 1.0' in metrics


def test_deadline_passing_while_streaming_stops_it_frees_its_blocks_and_ends_the_stream(
    harness, held, http
):
    gate, clock = held
    body = {**BODY, "stream": True}
    events = []
    with httpx.Client(timeout=HANG_S) as c:
        with c.stream(
            "POST", f"{http}/v1/completions", json=body, headers={"X-Request-Timeout": "30"}
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            gate.allow(2)  # the prefill and one decode
            gate.wait_steps(2)
            # Their tokens come as one chunk or two (a server slower than the engine merges
            # steps): the first is enough to know the stream is under way.
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            assert harness.engine.stats().num_running == 1
            clock.jump(60)
            gate.allow(1)
            events += [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert events[:-2] and all("choices" in json.loads(e) for e in events[:-2])
    err = json.loads(events[-2])["error"]
    assert err["code"] == "deadline_exceeded" and "while it was running" in err["message"]
    assert events[-1] == "[DONE]"
    wait_for(lambda: harness.engine.stats().kv_usage == 0, "blocks freed")
    assert harness.engine.stats().num_running == 0


def test_default_request_timeout_applies_when_the_request_sets_none(harness, held):
    gate, clock = held
    app = build_app(harness.engine, ServerConfig(default_request_timeout_s=5))
    with BackgroundServer(app) as srv, ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, f"{srv.url}/v1/completions", json=BODY, timeout=HANG_S)
        wait_for(lambda: harness.engine.stats().num_waiting == 1, "request queued")
        clock.jump(10)
        gate.allow(1)
        assert fut.result(HANG_S).status_code == 504


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan", ""])
def test_a_timeout_header_that_is_not_a_positive_finite_number_is_a_400(http, value):
    r = httpx.post(
        f"{http}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        headers={"X-Request-Timeout": value},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "X-Request-Timeout" and "positive, finite" in err["message"]


def test_native_grpc_deadline_exceeded(harness, held):
    gate, clock = held

    async def call() -> grpc.aio.AioRpcError:
        async with harness.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            req = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=20))
            call = stub.Generate(req, timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            return e.value

    task = asyncio.run_coroutine_threadsafe(call(), harness.loop.loop)
    wait_for(lambda: harness.engine.stats().num_waiting == 1, "call queued")
    clock.jump(120)
    gate.allow(1)
    err = task.result(HANG_S)
    assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "waited in the queue" in err.details()  # the engine's answer, not gRPC's own


def _infer_request(model: str, **params) -> kpb.ModelInferRequest:
    req = kpb.ModelInferRequest(model_name=model, id="1")
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    req.raw_input_contents.append(encode_bytes([b"hello"]))
    for k, v in params.items():
        req.parameters[k].CopyFrom(v)
    return req


def test_kserve_timeout_parameter_is_a_deadline(harness, held):
    gate, clock = held

    async def call() -> grpc.aio.AioRpcError:
        async with harness.channel() as ch:
            stub = kpb_grpc.GRPCInferenceServiceStub(ch)
            timeout = kpb.InferParameter(int64_param=30_000_000)  # 30 s in microseconds
            req = _infer_request(harness.engine.model_name, timeout=timeout)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ModelInfer(req)
            return e.value

    task = asyncio.run_coroutine_threadsafe(call(), harness.loop.loop)
    wait_for(lambda: harness.engine.stats().num_waiting == 1, "call queued")
    clock.jump(60)
    gate.allow(1)
    err = task.result(HANG_S)
    assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    "param",
    [kpb.InferParameter(string_param="5"), kpb.InferParameter(int64_param=-1),
     kpb.InferParameter(double_param=1.5)],
)  # fmt: skip
def test_kserve_bad_timeout_parameter_is_invalid_argument(harness, param):
    async def call() -> grpc.aio.AioRpcError:
        async with harness.channel() as ch:
            stub = kpb_grpc.GRPCInferenceServiceStub(ch)
            req = _infer_request(harness.engine.model_name, timeout=param)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ModelInfer(req)
            return e.value

    err = harness.run(call())
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("parameters.timeout:")


def test_tenancy_caller_deadline_is_arrival_plus_the_timeout():
    t = Tenancy(ServerConfig(default_request_timeout_s=7))
    assert t.caller(None, None, 100.0).deadline == 107.0
    assert t.caller(None, 2.5, 100.0).deadline == 102.5
    assert Tenancy(ServerConfig()).caller(None, None, 100.0).deadline is None
