"""gRPC statuses the real engine cannot produce on demand, against the deterministic fake.

UNAUTHENTICATED (api keys), RESOURCE_EXHAUSTED (queue full), INTERNAL (a failing step), and
health turning NOT_SERVING when the engine dies; after each error the server keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from appliance.grpc.auth import ApiKeyInterceptor, bearer_token
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb
from appliance.grpc.proto.inference import grpc_service_pb2_grpc as kpb_grpc
from tests.support.fake_engine import FakeLLMEngine
from tests.support.grpc_harness import Harness, start_harness
from tests.support.waiting import StepGate, wait_for

KEY = "sk-test-123"


@pytest.fixture()
def fake() -> Iterator[tuple[FakeLLMEngine, Harness]]:
    engine = FakeLLMEngine(max_num_seqs=1, max_queue_len=1)
    h = start_harness(engine, api_keys=(KEY, "other-key"))
    yield engine, h
    h.close()


def _auth(key: str = KEY) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def _generate(stub, metadata=_auth(), **sampling) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(text="hey", sampling=pb.SamplingParams(**sampling))
    return [r async for r in stub.Generate(req, metadata=metadata)]


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_bearer_token_parsing_and_constant_time_key_check() -> None:
    assert bearer_token([("authorization", "Bearer abc")]) == b"abc"
    assert bearer_token([("authorization", "bearer  abc ")]) == b"abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("x", "Bearer abc")]) is None
    check = ApiKeyInterceptor(["k1", "k2"])
    assert check.authorized([("authorization", "Bearer k2")])
    assert not check.authorized([("authorization", "Bearer k3")])


def test_api_keys_guard_every_service_but_probes(fake) -> None:
    _, h = fake

    async def main() -> dict:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            kstub = kpb_grpc.GRPCInferenceServiceStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            return {
                "none": await _code(_generate(stub, metadata=None, max_tokens=2)),
                "wrong": await _code(_generate(stub, metadata=_auth("nope"), max_tokens=2)),
                "models": await _code(stub.ListModels(pb.ListModelsRequest())),
                "kserve": await _code(kstub.ModelMetadata(kpb.ModelMetadataRequest(name="x"))),
                "ok": await _code(_generate(stub, metadata=_auth("other-key"), max_tokens=2)),
                "health": await _code(health.Check(health_pb2.HealthCheckRequest())),
                "live": await _code(kstub.ServerLive(kpb.ServerLiveRequest())),
            }

    codes = h.run(main())
    unauth = grpc.StatusCode.UNAUTHENTICATED
    assert (codes["none"], codes["wrong"], codes["models"], codes["kserve"]) == (unauth,) * 4
    assert codes["ok"] == codes["health"] == codes["live"] == grpc.StatusCode.OK


def test_full_queue_is_resource_exhausted_and_the_server_keeps_serving(fake) -> None:
    engine, h = fake
    # Steps are held until one request has been refused: the first one waits in the queue
    # (of one) meanwhile, so a refusal must come, and then everything accepted finishes.
    gate = StepGate(engine)

    async def one(stub) -> grpc.StatusCode:
        code = await _code(_generate(stub, max_tokens=20))
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            gate.open()
        return code

    async def main() -> tuple[list, str]:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            codes = await asyncio.gather(*[one(stub) for _ in range(4)])
            after = await _generate(stub, max_tokens=2)
            return codes, after[-1].finish_reason

    codes, after = h.run(main())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
    assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OK}
    assert after == "length"


def test_failed_step_is_internal_and_the_server_keeps_serving(fake) -> None:
    engine, h = fake

    async def main() -> list:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            engine.fail_steps = 1
            try:
                await _generate(stub, max_tokens=3)
                failed = None
            except grpc.aio.AioRpcError as e:
                failed = (e.code(), e.details())
            ok = await _generate(stub, max_tokens=3)
            return [failed, "".join(r.text for r in ok)]

    (code, details), text = h.run(main())
    assert code == grpc.StatusCode.INTERNAL and "injected step failure" in details
    assert len(text) == 3


def test_health_is_not_serving_once_the_engine_is_dead(fake) -> None:
    engine, h = fake

    async def status(service: str = "") -> int:
        async with h.channel() as ch:
            health = health_pb2_grpc.HealthStub(ch)
            return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

    serving = health_pb2.HealthCheckResponse.SERVING
    assert h.run(status()) == h.run(status("appliance.v1.Appliance")) == serving
    engine.fail_steps = 10  # three failing steps in a row kill the engine

    async def doomed() -> None:
        async with h.channel() as ch:
            for _ in range(3):  # each request fails in one step
                await _code(_generate(pb_grpc.ApplianceStub(ch), max_tokens=30))

    h.run(doomed())
    wait_for(lambda: not h.engine.is_healthy, "engine dead")
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    wait_for(lambda: h.run(status("inference.GRPCInferenceService")) == not_serving,
             "health NOT_SERVING")  # fmt: skip
    assert h.run(status()) == not_serving

    async def ready() -> bool:
        async with h.channel() as ch:
            kstub = kpb_grpc.GRPCInferenceServiceStub(ch)
            return (await kstub.ServerReady(kpb.ServerReadyRequest())).ready

    assert h.run(ready()) is False
