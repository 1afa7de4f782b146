"""Faults: a model step that raises, an engine that cannot recover, a step that hangs, SIGTERM.

- An exception injected into one model step fails the requests of that step (HTTP 500 in
  OpenAI format, an SSE error event, gRPC INTERNAL, a KServe in-band error) and the engine
  recovers: the next requests return exactly the greedy output of an undisturbed run.
- A persistent failure kills the engine: /health, /ready and gRPC health turn unhealthy,
  requests get 503 / UNAVAILABLE, and `appliance serve` exits non-zero instead of hanging.
- A hung step trips the watchdog (`server.step_timeout_s`) the same way.
- SIGTERM drains in-flight HTTP and gRPC streams within the grace period and exits 0; a
  request that outlives the grace period is cut, and the process still exits 0 on time.

Nothing here waits on the clock for a verdict: requests are held in flight by a step gate
(`tests.support.waiting.StepGate`, or the `gate` fault of `tests.support.fault_launcher` in a subprocess),
so "still running" and "can never finish" hold by construction, on any box.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from appliance.config import ServerConfig
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.grpc.proto.inference import grpc_service_pb2_grpc as kpb_grpc
from appliance.http.app import build_app
from engine.async_engine import AsyncEngine
from engine.errors import RequestFailedError
from engine.sampling_params import SamplingParams
from tests.serving.test_bad_input_grpc import _kserve, _sp
from tests.support.fake_engine import FakeLLMEngine
from tests.support.served_stack import (
    Stack,
    gauges,
    served,
    spawn_serve,
    tiny_engine,
    tiny_serve_sets,
    wait_idle_and_free,
)
from tests.support.waiting import HANG_S, StepGate, wait_for, wait_for_async

GREEDY = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StepFaults:
    """Makes the next `n` model steps raise (set `n`); counts the steps that ran."""

    def __init__(self, llm: Any):
        runner = llm.runner
        execute = runner.execute
        self.n = 0
        self.always = False

        def faulty(so: Any) -> Any:
            if not so.is_empty and (self.always or self.n > 0):
                self.n -= 1
                raise RuntimeError("injected device error")
            return execute(so)

        runner.execute = faulty


@pytest.fixture()
def stack(tiny_llama_dir: Path) -> Iterator[tuple[Stack, StepFaults]]:
    llm = tiny_engine(tiny_llama_dir)
    faults = StepFaults(llm)
    with served(llm, health_poll_s=0.05) as s:
        yield s, faults


async def _grpc_generate(address: str, **sampling: Any) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(address) as ch:
        req = pb.GenerateRequest(text="Once upon a time", sampling=pb.SamplingParams(**sampling))
        try:
            async for _ in pb_grpc.ApplianceStub(ch).Generate(req):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def _health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status


def test_a_failing_step_fails_its_requests_in_each_protocol_and_the_engine_recovers(
    stack,
) -> None:
    s, faults = stack
    expected = httpx.post(f"{s.url}/v1/completions", json=GREEDY, timeout=HANG_S).json()

    def recovered() -> None:
        """The next request gets exactly the undisturbed greedy text; no block is held."""
        r = httpx.post(f"{s.url}/v1/completions", json=GREEDY, timeout=HANG_S).json()
        assert r["choices"][0]["text"] == expected["choices"][0]["text"]
        assert s.aeng.is_healthy
        wait_idle_and_free(s.aeng)

    faults.n = 1
    r = httpx.post(f"{s.url}/v1/completions", json=GREEDY, timeout=HANG_S)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_error"
    assert "injected device error" in err["message"]
    recovered()

    faults.n = 1
    with httpx.stream("POST", f"{s.url}/v1/completions", json={**GREEDY, "stream": True}) as r:
        raw = r.read().decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_error"
    recovered()

    faults.n = 1
    code, details = s.run(_grpc_generate(s.grpc_address, max_tokens=8))
    assert code == grpc.StatusCode.INTERNAL and "injected device error" in details
    recovered()

    async def kserve_stream() -> list:
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            stub = kpb_grpc.GRPCInferenceServiceStub(ch)
            req = _kserve(stream=True, sampling=_sp(max_tokens=4))
            return [x async for x in stub.ModelStreamInfer(iter([req]))]

    faults.n = 1
    (only,) = s.run(kserve_stream())
    assert "injected device error" in only.error_message
    recovered()
    assert s.aeng.num_failed_steps == 4


def test_a_persistent_failure_turns_every_health_signal_unhealthy(stack) -> None:
    s, faults = stack
    faults.always = True
    for _ in range(s.aeng.max_consecutive_failures):
        assert httpx.post(f"{s.url}/v1/completions", json=GREEDY).status_code in (500, 503)
    wait_for(lambda: not s.aeng.is_healthy, "engine dead")
    for path in ("/health", "/ready"):
        r = httpx.get(f"{s.url}{path}")
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    r = httpx.post(f"{s.url}/v1/completions", json=GREEDY)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert s.run(_grpc_generate(s.grpc_address))[0] == grpc.StatusCode.UNAVAILABLE
    wait_for(lambda: s.run(_health(s.grpc_address)) == NOT_SERVING, "grpc NOT_SERVING")
    assert s.run(_health(s.grpc_address, "appliance.v1.Appliance")) == NOT_SERVING


def test_only_the_failed_steps_requests_fail_with_the_fake_engine() -> None:
    """AsyncEngine's side of the contract: what `fail_step` does not fail carries on."""
    fake = FakeLLMEngine(max_num_seqs=1)
    aeng = AsyncEngine(fake)
    gate = StepGate(fake, permits=1)  # "a" runs one step, then is held: it cannot finish

    async def main() -> tuple[BaseException | None, int]:
        first = await aeng.add_request("a", SamplingParams(max_tokens=50))
        second = await aeng.add_request("b", SamplingParams(max_tokens=3))  # waits its turn
        await first.__anext__()
        fake.fail_steps = 1
        gate.open()
        failed: BaseException | None = None
        try:
            async for _ in first:
                pass
        except RequestFailedError as e:
            failed = e
        out = await second.result()
        await aeng.shutdown()
        return failed, len(out.outputs[0].token_ids)

    failed, second_tokens = asyncio.run(asyncio.wait_for(main(), HANG_S))
    assert isinstance(failed, RequestFailedError) and second_tokens == 3


def test_only_the_failed_steps_requests_fail_with_the_real_engine(tiny_llama_dir: Path) -> None:
    llm = tiny_engine(tiny_llama_dir, max_num_seqs=1)
    faults = StepFaults(llm)
    aeng = AsyncEngine(llm)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main() -> tuple[bool, list[int], list[int]]:
        reference = (
            (await (await aeng.add_request([5, 6, 7], params)).result()).outputs[0].token_ids
        )
        gate = StepGate(llm, permits=1)  # the running request gets one step, then is held
        running = await aeng.add_request([8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
        waiting = await aeng.add_request([5, 6, 7], params)
        await running.__anext__()
        faults.n = 1
        gate.open()
        try:
            async for _ in running:
                pass
            running_failed = False
        except RequestFailedError:
            running_failed = True
        got = (await waiting.result()).outputs[0].token_ids
        await aeng.shutdown()
        return running_failed, got, reference

    running_failed, got, reference = asyncio.run(asyncio.wait_for(main(), HANG_S))
    assert running_failed and got == reference


def test_a_hung_step_trips_the_watchdog_and_health_turns_unhealthy() -> None:
    entered, release = threading.Event(), threading.Event()
    fake = FakeLLMEngine()
    step = fake.step

    def hanging_step() -> Any:
        entered.set()
        release.wait()
        return step()

    fake.step = hanging_step
    aeng = AsyncEngine(fake, step_timeout_s=0.2)

    async def main() -> None:
        transport = httpx.ASGITransport(app=build_app(aeng, ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            stuck = asyncio.create_task(c.post("/v1/completions", json={"prompt": "a"}))
            # The step cannot return before `release`: the watchdog must trip meanwhile.
            await wait_for_async(entered.is_set, "the step started")
            await wait_for_async(lambda: not aeng.is_healthy, "the watchdog tripped")
            assert "step_timeout_s" in (aeng.dead_reason or "")
            r = await c.get("/health")
            assert r.status_code == 503 and "running for" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"prompt": "b"})
            assert r.status_code == 503
            release.set()  # the step returns: the passive watchdog clears
            assert (await stuck).status_code == 200
            assert aeng.is_healthy
        await aeng.shutdown()

    try:
        asyncio.run(asyncio.wait_for(main(), HANG_S))
    finally:
        release.set()


# ---- `appliance serve` as a process ----------------------------------------------------------
def _serve(model_dir: Path, fault: str, arg: Any, **sets: Any) -> Any:
    args = [fault, str(arg), "--", "serve", *tiny_serve_sets(model_dir, **sets)]
    return spawn_serve(args, module="tests.support.fault_launcher")


def _post_quietly(url: str, body: dict) -> int | None:
    try:
        return httpx.post(url, json=body, timeout=HANG_S).status_code
    except httpx.HTTPError:
        return None  # the server may already be going down


@pytest.mark.parametrize(
    "fault, sets",
    [("fail_after", {}), ("hang_after", {"server.step_timeout_s": 1.0})],
    ids=["persistent failure", "hung step"],
)
def test_serve_exits_nonzero_when_the_engine_dies(tiny_llama_dir, fault, sets) -> None:
    # A grace period far beyond the hang guard: a server that waited it out for a dead
    # engine would fail the test, however fast the box.
    sets = {"server.shutdown_grace_s": 100 * HANG_S, **sets}
    sp = _serve(tiny_llama_dir, fault, 4, **sets)  # the first 4 model steps are healthy
    try:
        assert _post_quietly(f"{sp.url}/v1/completions", {"prompt": "hi", "max_tokens": 2}) == 200
        # One request at a time, each answered before the next: each fails in a step of
        # its own (three in a row kill the engine), or the first one hangs.
        for _ in range(3):
            if sp.proc.poll() is not None:
                break
            _post_quietly(f"{sp.url}/v1/completions", {"prompt": "hi", "max_tokens": 4})
        code = sp.proc.wait(HANG_S)
    finally:
        sp.kill()
    assert code == 3, sp.records[-5:]
    assert sp.logged("engine died; shutting down")


class _FileGate:
    """The test's side of `tests.support.fault_launcher`'s `gate` fault: how many steps may run."""

    def __init__(self, path: Path):
        self.path = path
        self.set(0)

    def set(self, steps: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(str(steps))
        tmp.replace(self.path)  # the server never reads a half-written number


def _http_stream(url: str, max_tokens: int, results: dict, name: str) -> None:
    body = {**GREEDY, "max_tokens": max_tokens, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HANG_S) as r:
            results[name] = "".join(r.iter_text())
    except httpx.HTTPError as e:  # cut mid-stream
        results[name] = f"cut: {e!r}"


async def _grpc_stream(address: str, max_tokens: int, results: dict) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        req = pb.GenerateRequest(
            text="hi", sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
        try:
            results["grpc"] = [r async for r in pb_grpc.ApplianceStub(ch).Generate(req)]
        except grpc.aio.AioRpcError as e:  # cut mid-stream
            results["grpc"] = e.code()


def _start_streams(sp: Any, max_tokens: int, results: dict) -> list[threading.Thread]:
    """One HTTP and one gRPC stream, each on a thread of its own."""
    threads = [
        threading.Thread(target=_http_stream, args=(sp.url, max_tokens, results, "http")),
        threading.Thread(
            target=lambda: asyncio.run(_grpc_stream(sp.grpc_address, max_tokens, results))
        ),
    ]
    for t in threads:
        t.start()
    return threads


def _sigterm_mid_stream(sp: Any, gate: _FileGate) -> int | None:
    """Once both streams are in the engine, lets one step run (both are then mid-stream,
    holding KV blocks), sends SIGTERM, waits for the drain to begin and returns the status
    of a request sent after it (refused: None or 503)."""
    wait_for(lambda: gauges(sp.url)["appliance_requests_in_flight"] == 2, "two streams in")
    gate.set(1)
    wait_for(lambda: gauges(sp.url)["appliance_requests_running"] == 2, "both running")
    sp.proc.send_signal(signal.SIGTERM)
    # "Once draining began": the signal is handled on the server's loop, so wait for it.
    wait_for(lambda: bool(sp.logged("shutdown requested")), "the drain to begin")
    return _post_quietly(f"{sp.url}/v1/completions", GREEDY)


def test_sigterm_drains_in_flight_streams_and_exits_0(tiny_llama_dir, tmp_path) -> None:
    """Streams held mid-stream when SIGTERM comes are released once the drain has begun;
    they finish during the grace period (far longer than they need), the process exits 0."""
    gate = _FileGate(tmp_path / "steps")
    sp = _serve(tiny_llama_dir, "gate", gate.path, **{"server.shutdown_grace_s": HANG_S})
    results: dict[str, Any] = {}
    try:
        threads = _start_streams(sp, 30, results)
        refused = _sigterm_mid_stream(sp, gate)
        gate.set(10**9)
        for t in threads:
            t.join(HANG_S)
        code = sp.proc.wait(HANG_S)
    finally:
        sp.kill()
    assert code == 0, sp.records[-5:]
    assert refused in (None, 503)  # no new work once draining began
    assert results["http"].endswith("data: [DONE]\n\n"), results["http"][-200:]
    assert '"finish_reason":"length"' in results["http"]
    assert results["grpc"][-1].finish_reason == "length", results["grpc"]
    assert results["grpc"][-1].usage.completion_tokens == 30


def test_sigterm_cuts_what_outlives_the_grace_and_exits_0(tiny_llama_dir, tmp_path) -> None:
    """Streams held forever (one step, then no more) outlive any grace period: they are cut
    when it ends and the process still exits 0. A server that waited for them would never
    exit, so the hang guard, not a stopwatch, catches it. The cut HTTP stream still ends as
    a whole SSE body: an error event saying why, then [DONE] (not a truncated chunked body,
    which clients report as a network error)."""
    gate = _FileGate(tmp_path / "steps")
    sp = _serve(tiny_llama_dir, "gate", gate.path, **{"server.shutdown_grace_s": 0.5})
    results: dict[str, Any] = {}
    try:
        threads = _start_streams(sp, 100, results)
        _sigterm_mid_stream(sp, gate)
        code = sp.proc.wait(HANG_S)
        for t in threads:
            t.join(HANG_S)
    finally:
        sp.kill()
    assert code == 0, sp.records[-5:]
    http = results["http"]
    assert not http.startswith("cut:"), http
    *events, last_event, done = [e for e in http.split("\n\n") if e]
    assert done == "data: [DONE]", http[-300:]
    assert json.loads(last_event.removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert all("error" not in json.loads(e.removeprefix("data: ")) for e in events), http
    assert isinstance(results["grpc"], grpc.StatusCode), results["grpc"]
