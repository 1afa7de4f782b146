"""Shared set-up for the gRPC and tracing tests (no tests here).

A real server runs on an asyncio loop in a background thread, on 127.0.0.1 with a free
port; grpc.aio clients run on the same loop through `Harness.run`, while blocking clients
(tritonclient) call from the test thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from appliance.adapters import AdapterRegistry
from appliance.config.schema import LoRASection
from appliance.grpc.server import GrpcSettings, start_grpc_server
from appliance.telemetry import Tracing
from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from tests.support.offline import run_to_finals
from tests.support.waiting import HANG_S

T = TypeVar("T")
PROMPTS = ["The capital of France is", "Once upon a time there was"]


class LoopThread:
    """An event loop on a daemon thread; `run(coro)` blocks the caller until it finishes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = HANG_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@dataclass
class Harness:
    loop: LoopThread
    engine: AsyncEngine
    server: grpc.aio.Server
    port: int
    adapters: AdapterRegistry

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = HANG_S) -> T:
        return self.loop.run(coro, timeout)

    def channel(self) -> grpc.aio.Channel:
        """A new channel on the harness loop (create it inside a coroutine run by `run`)."""
        return grpc.aio.insecure_channel(self.address)

    def close(self) -> None:
        async def stop() -> None:
            await self.server.stop(0)
            await self.engine.shutdown(0)

        self.run(stop())
        self.loop.close()


def tiny_llm_engine(model_dir: Path, **overrides: Any) -> Any:
    from engine.llm import build_engine_config
    from engine.llm_engine import LLMEngine

    kw = {"num_kv_blocks": 128, "block_size": 4, "dtype": "float32", **overrides}
    return LLMEngine(build_engine_config(str(model_dir), **kw))


def start_harness(
    llm_engine: Any,
    tracing: Tracing | None = None,
    lora: LoRASection | None = None,
    **settings: Any,
) -> Harness:
    """Wraps `llm_engine` in an AsyncEngine and serves it on a free port; with `lora`, its
    `modules` are loaded first (as `appliance serve` does) into `Harness.adapters`."""
    loop = LoopThread()
    engine = AsyncEngine(llm_engine)
    adapters = AdapterRegistry(engine, lora or LoRASection(), engine.model_name)
    loop.run(adapters.load_modules())
    opts = {"host": "127.0.0.1", "port": 0, "health_poll_s": 0.05, **settings}
    server = loop.run(start_grpc_server(engine, GrpcSettings(**opts), tracing, adapters))
    return Harness(loop, engine, server, server.bound_port, adapters)


def offline_greedy(llm_engine: Any, prompts: list, max_tokens: int) -> list[tuple[list[int], str]]:
    """The engine driven directly (add_request / step), before any server wraps it."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        llm_engine.add_request(f"offline-{i}", p, params)
    done = run_to_finals(llm_engine)
    outs = [done[f"offline-{i}"].outputs[0] for i in range(len(prompts))]
    return [(c.token_ids, c.text) for c in outs]
