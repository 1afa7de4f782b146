"""Storms: far too little KV cache for the load, and clients that vanish mid-stream.

Preemption storm: a KV pool of about a tenth of what the requests need at once. Every
request still completes, and its greedy tokens equal those of a run with a pool large
enough never to preempt (prefix-cache hits, chunked prompts and recomputation included).

Disconnect storm: HTTP clients drop their connection and gRPC clients cancel (or let a
deadline pass) at random points, from before the first token to deep into the stream.
Every vanished client's request is aborted, before the engine's next step once the server
asks for it, every KV block comes back, and no thread, asyncio task, uvicorn connection or
engine stream is left over.

Neither storm waits on the clock: the preemption storm holds the engine until every
request is queued (so the schedule, and the preemptions, are the same on any box), and the
disconnect storm's requests can never reach their last token (the engine is held while one
of them is a token short), so each client surely leaves mid-stream however slow it is.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from engine.async_engine import AsyncEngine, FinishedRequest
from engine.sampling_params import SamplingParams
from tests.support.offline import run_to_finals
from tests.support.served_stack import (
    Stack,
    live_threads,
    loop_tasks,
    served,
    tiny_engine,
    wait_idle_and_free,
)
from tests.support.waiting import HANG_S, StepGate, wait_for, wait_for_async

# ---- preemption storm ------------------------------------------------------------------------
NUM_STORM_REQUESTS = 24
STORM_MAX_TOKENS = 40
BLOCK_SIZE = 4


def _storm_prompts() -> list[list[int]]:
    """Prompts of 9-24 tokens; a third share a 12-token prefix (prefix-cache hits)."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(12)]
    out = []
    for i in range(NUM_STORM_REQUESTS):
        tail = [rng.randrange(3, 500) for _ in range(rng.randint(9, 12))]
        out.append(shared + tail if i % 3 == 0 else tail + tail[: rng.randint(0, 12)])
    return out


def _demand_blocks(prompts: list[list[int]]) -> int:
    return sum(-(-(len(p) + STORM_MAX_TOKENS) // BLOCK_SIZE) for p in prompts)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=STORM_MAX_TOKENS, ignore_eos=True)


def _offline(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    for i, p in enumerate(prompts):
        llm.add_request(f"ref-{i}", p, _greedy())
    done = run_to_finals(llm)
    return [done[f"ref-{i}"].outputs[0].token_ids for i in range(len(prompts))]


def test_preemption_storm_completes_everything_with_unconstrained_greedy_output(
    tiny_llama_dir: Path,
) -> None:
    prompts = _storm_prompts()
    demand = _demand_blocks(prompts)
    roomy = tiny_engine(tiny_llama_dir, num_kv_blocks=demand + 64, block_size=BLOCK_SIZE,
                        max_num_seqs=NUM_STORM_REQUESTS)  # fmt: skip
    expected = _offline(roomy, prompts)
    assert roomy.stats().num_preemptions == 0
    del roomy
    pool = demand // 10  # about a tenth of the demand; one request alone still fits
    assert pool >= max(-(-(len(p) + STORM_MAX_TOKENS) // BLOCK_SIZE) for p in prompts)
    # Context 64: the longest prompt (24) plus STORM_MAX_TOKENS, so the pool holds one.
    tight = tiny_engine(tiny_llama_dir, num_kv_blocks=pool, block_size=BLOCK_SIZE, max_model_len=64,
                        max_num_seqs=NUM_STORM_REQUESTS, max_num_batched_tokens=64)  # fmt: skip
    aeng = AsyncEngine(tight)
    gate = StepGate(tight)  # held until every request is queued: the same storm on any box

    async def one(i: int) -> list[int]:
        out = await (await aeng.add_request(prompts[i], _greedy(), f"storm-{i}")).result()
        assert out.finished and out.outputs[0].finish_reason == "length"
        return out.outputs[0].token_ids

    async def main() -> list[list[int]]:
        try:
            calls = asyncio.gather(*[one(i) for i in range(len(prompts))])
            await wait_for_async(lambda: aeng.stats().num_waiting == len(prompts), "all queued")
            gate.open()
            return await asyncio.wait_for(calls, HANG_S)
        finally:
            wait_idle_and_free(aeng)
            await aeng.shutdown()

    got = asyncio.run(main())
    stats = tight.stats()
    print(
        f"preemption storm: {len(prompts)} requests, demand {demand} blocks, pool {pool}, "
        f"{stats.num_preemptions} preemptions"
    )  # docs/reliability.md
    assert stats.num_preemptions >= len(prompts)  # a storm, not a breeze
    assert got == expected


# ---- disconnect storm ------------------------------------------------------------------------
NUM_HTTP_VANISH = 40
NUM_GRPC_CANCEL = 40
VANISH_MAX_TOKENS = 100


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    llm = tiny_engine(tiny_llama_dir, max_num_seqs=96, num_kv_blocks=1024)
    with served(llm) as s:
        yield s


class NoLastToken:
    """Holds the engine's steps while some request is one token short of VANISH_MAX_TOKENS:
    no request can finish, so every client leaves mid-stream, however slow it is.

    (A held step computes nothing, so aborts still land and free the holder's place.)"""

    def __init__(self, llm: Any):
        self.llm = llm
        self.tokens: dict[str, int] = {}
        self._step = llm.step
        llm.step = self._counting_step
        self.gate = StepGate(llm, permits=None, hold_while=self._one_short)

    def _counting_step(self) -> list:
        outs = self._step()
        for o in outs:  # deltas: count each request's tokens so far (its samples in step)
            new = max((len(c.token_ids) for c in o.outputs), default=0)
            self.tokens[o.request_id] = self.tokens.get(o.request_id, 0) + new
        return outs

    def _one_short(self) -> bool:  # engine thread
        for rid in [r for r in self.tokens if not self.llm.has_request(r)]:
            del self.tokens[rid]
        return any(n >= VANISH_MAX_TOKENS - 1 for n in self.tokens.values())

    def remove(self) -> None:
        self.gate.remove()
        self.llm.step = self._step


class AbortClock:
    """Engine step counts: when each client vanished, when the server asked the engine to
    abort its request, and when the engine did."""

    def __init__(self, aeng: AsyncEngine):
        self.aeng = aeng
        self.vanished: dict[str, int] = {}
        self.requested: dict[str, int] = {}
        self.aborted: dict[str, int] = {}
        self.finished: set[str] = set()  # every request the engine held, however it ended
        aeng.add_finish_listener(self._on_finish)
        abort = aeng.abort

        def asked(request_id: str) -> None:  # any thread: how every frontend aborts
            self.requested.setdefault(request_id, aeng.num_steps)
            abort(request_id)

        aeng.abort = asked  # type: ignore[method-assign]

    def _on_finish(self, f: FinishedRequest) -> None:  # engine thread
        # A gRPC deadline is the engine's deadline too (issue 31): when it passes the engine
        # ends the request itself at its next step, which is as good as the abort that the
        # server asks for as it answers DEADLINE_EXCEEDED (that one then finds nothing).
        self.finished.add(f.request_id)
        expired = f.metrics is not None and f.metrics.expired_time is not None
        if f.finish_reason == "abort" or expired:
            self.aborted[f.request_id] = self.aeng.num_steps

    def vanish(self, request_id: str) -> None:
        self.vanished[request_id] = self.aeng.num_steps

    def engine_lags(self) -> list[int]:
        """Steps from the server's abort call to the engine's abort."""
        return [self.aborted[r] - s for r, s in self.requested.items() if r in self.aborted]

    def client_lags(self) -> list[int]:
        """Steps from the client leaving to the engine's abort (includes how long the server
        took to notice: I/O and event-loop latency, reported, not asserted)."""
        return [self.aborted[r] - s for r, s in self.vanished.items() if r in self.aborted]


def _tokens(chunk: dict) -> int:
    return sum(len((c.get("logprobs") or {}).get("tokens") or []) for c in chunk["choices"])


async def _http_vanish(c: httpx.AsyncClient, rng: random.Random, clock: AbortClock) -> None:
    # logprobs 0: every chunk lists its tokens, so the client counts tokens, not chunks (a
    # server slower than the engine merges several steps into one chunk).
    body = {"prompt": "Once upon a time", "max_tokens": VANISH_MAX_TOKENS, "ignore_eos": True,
            "stream": True, "logprobs": 0}  # fmt: skip
    leave_after = rng.choice([0, 0, 1, 2, 5, 20])
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        seen, buf = 0, b""
        async for data in r.aiter_bytes():
            if seen >= leave_after:
                break
            # Whole SSE events only (a token's text may hold characters that line
            # splitters, unlike SSE, treat as line breaks).
            *events, buf = (buf + data).split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {"):
                    chunk = json.loads(event[6:])
                    assert not any(ch["finish_reason"] for ch in chunk["choices"]), chunk
                    seen += _tokens(chunk)
        clock.vanish(rid)
    # Leaving the block closes the connection (the pool keeps no half-read response).


async def _http_timeout(c: httpx.AsyncClient, rng: random.Random) -> None:
    """A non-streamed request whose client gives up while the answer is being generated."""
    body = {"prompt": "A journey of", "max_tokens": VANISH_MAX_TOKENS, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        await c.post("/v1/completions", json=body, timeout=rng.uniform(0.05, 0.3))


async def _grpc_cancel(stub: pb_grpc.ApplianceStub, i: int, rng: random.Random,
                       clock: AbortClock) -> None:  # fmt: skip
    rid = f"cancel-{i}"
    req = pb.GenerateRequest(text="The quick brown fox", request_id=rid,
                             sampling=pb.SamplingParams(max_tokens=VANISH_MAX_TOKENS,
                                                        ignore_eos=True))  # fmt: skip
    if i % 5 == 0:  # a deadline that passes mid-stream
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(req, timeout=rng.uniform(0.05, 0.3)):
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return
    call = stub.Generate(req)
    leave_after = rng.choice([0, 1, 3, 10])
    seen = 0
    while seen < leave_after:
        r = await call.read()
        assert not r.finish_reason, r
        seen += len(r.token_ids)
    if leave_after:  # with none, the server may not have seen the call before it was cancelled
        clock.vanish(rid)
    call.cancel()


def test_disconnect_storm_aborts_every_request_and_leaves_nothing_behind(stack: Stack) -> None:
    aeng = stack.aeng
    httpx.post(f"{stack.url}/v1/completions", json={"prompt": "warm", "max_tokens": 2})
    wait_idle_and_free(aeng)
    clock = AbortClock(aeng)
    held = NoLastToken(aeng.engine)
    threads_before = live_threads()
    tasks_before = loop_tasks(stack.grpc.loop.loop)
    rng = random.Random(3)

    async def main() -> None:
        async with (
            httpx.AsyncClient(base_url=stack.url, timeout=HANG_S, limits=httpx.Limits(max_connections=200)) as c,
            grpc.aio.insecure_channel(stack.grpc_address) as ch,
        ):  # fmt: skip
            stub = pb_grpc.ApplianceStub(ch)
            calls = [_http_vanish(c, random.Random(rng.random()), clock)
                     for _ in range(NUM_HTTP_VANISH)]  # fmt: skip
            calls += [_http_timeout(c, random.Random(rng.random())) for _ in range(10)]
            calls += [_grpc_cancel(stub, i, random.Random(rng.random()), clock)
                      for i in range(NUM_GRPC_CANCEL)]  # fmt: skip
            rng.shuffle(calls)
            await asyncio.wait_for(asyncio.gather(*calls), HANG_S)

    try:
        stack.run(main(), timeout=HANG_S + 30)
        wait_idle_and_free(aeng)
    finally:
        held.remove()
    engine_lags, client_lags = clock.engine_lags(), clock.client_lags()
    print(
        f"disconnect storm: {NUM_HTTP_VANISH + 10 + NUM_GRPC_CANCEL} clients vanished, "
        f"{len(engine_lags)} requests aborted; steps from the client leaving to the abort: "
        f"median {statistics.median(client_lags)} max {max(client_lags)}; from the server's "
        f"abort call: max {max(engine_lags)}"
    )  # docs/reliability.md
    missing = set(clock.vanished) - set(clock.aborted)
    assert not missing, f"vanished clients' requests never aborted: {sorted(missing)}"
    # Every abort asked of a request the engine held was applied. (A deadline may pass while
    # the request is still being prepared: it is refused before the engine holds it, and the
    # abort the server then asks for has nothing to find.)
    held_ids = {r for r in clock.requested if r in clock.finished}
    assert held_ids == {r for r in clock.aborted if r in clock.requested}
    # The engine applies an abort before its next step: a step already running when the
    # server asks may finish first, never a second one.
    assert max(engine_lags) <= 1, sorted(engine_lags)
    # Nothing left behind: uvicorn's per-connection tasks, the gRPC loop's tasks, threads.
    http_state = stack.http.server.server_state
    wait_for(lambda: not http_state.tasks and not http_state.connections, "uvicorn idle")
    wait_for(lambda: len(loop_tasks(stack.grpc.loop.loop)) <= len(tasks_before),
             "grpc tasks back to baseline")  # fmt: skip
    wait_for(lambda: live_threads() <= threads_before, "threads back to baseline")
    assert aeng.num_in_flight == 0
