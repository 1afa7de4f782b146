"""One AsyncEngine served over HTTP and gRPC at once, for the reliability suites (no tests).

The reliability checks (bad input, load, storms, faults, security, fuzzing) need the same
thing: the real engine on the tiny checkpoint, the OpenAI HTTP app under uvicorn and the
gRPC services, sharing one AsyncEngine exactly as `appliance serve` shares it, plus a few
probes (is the engine idle, is every KV block free, which threads and tasks are alive).
The gRPC side reuses `tests.support.grpc_harness` (its loop thread runs gRPC clients too);
HTTP runs in `BackgroundServer`'s own thread and event loop, as in production a second
frontend would.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config import ServerConfig
from appliance.http.app import build_app
from appliance.http.server import BackgroundServer
from appliance.tenancy import Tenancy
from engine.async_engine import AsyncEngine
from engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tests.support.grpc_harness import Harness, start_harness
from tests.support.waiting import HANG_S, wait_for

MAX_MODEL_LEN = 128


def tiny_engine(
    model_dir: Path,
    *,
    num_kv_blocks: int = 256,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    max_model_len: int = MAX_MODEL_LEN,
    speculative: SpeculativeConfig | None = None,
    **scheduler: Any,
) -> Any:
    """An LLMEngine on the tiny checkpoint, small enough that every suite stays fast on two
    shared cores: context 128 (as test_http_openai.py) unless `max_model_len` says
    otherwise, max_n 4, one torch thread.
    `scheduler` overrides SchedulerConfig fields; `speculative`: speculative decoding."""
    from engine.llm_engine import LLMEngine

    sched = {"max_num_seqs": 32, "max_n": 4, **scheduler}
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(
                path=str(model_dir), served_name="tiny", max_model_len=max_model_len,
                dtype="float32",
            ),
            cache=CacheConfig(
                block_size=block_size, num_kv_blocks=num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(**sched),
            runtime=RuntimeConfig(device="cpu", num_threads=1),
            speculative=speculative or SpeculativeConfig(),
        )
    )  # fmt: skip


@dataclass
class Stack:
    """HTTP at `url`, gRPC at `grpc_address`, one engine behind both."""

    grpc: Harness
    http: BackgroundServer

    @property
    def aeng(self) -> AsyncEngine:
        return self.grpc.engine

    @property
    def url(self) -> str:
        return self.http.url

    @property
    def grpc_address(self) -> str:
        return self.grpc.address

    def run(self, coro: Any, timeout: float = HANG_S) -> Any:
        """Runs a coroutine on the gRPC harness loop (where grpc.aio channels must live)."""
        return self.grpc.run(coro, timeout)

    def close(self) -> None:
        self.http.stop()
        self.grpc.close()


def start_stack(
    llm_engine: Any,
    server: ServerConfig | None = None,
    *,
    max_consecutive_failures: int = 3,
    **grpc_settings: Any,
) -> Stack:
    """Serves `llm_engine` over both protocols on free ports of 127.0.0.1 (`lora=` among
    `grpc_settings`: the adapters both frontends share, see `start_harness`)."""
    server = server or ServerConfig(host="127.0.0.1", http_port=0)
    if server.api_keys:
        grpc_settings.setdefault("api_keys", server.api_keys)
    grpc_settings.setdefault("max_receive_bytes", server.max_request_body)
    grpc_settings.setdefault("cache_salt_by_api_key", server.cache_salt_by_api_key)
    grpc_settings.setdefault("tenancy", Tenancy(server))
    harness = start_harness(llm_engine, **grpc_settings)
    harness.engine.max_consecutive_failures = max_consecutive_failures
    http = BackgroundServer(
        build_app(harness.engine, server, adapters=harness.adapters), server
    ).start()
    return Stack(harness, http)


@contextmanager
def served(llm_engine: Any, server: ServerConfig | None = None, **kw: Any) -> Iterator[Stack]:
    stack = start_stack(llm_engine, server, **kw)
    try:
        yield stack
    finally:
        stack.close()


def is_idle(aeng: AsyncEngine) -> bool:
    s = aeng.stats()
    return aeng.num_in_flight == 0 and s.num_running == 0 and s.num_waiting == 0


def leaked_blocks(aeng: AsyncEngine) -> int:
    """KV blocks still held by some request (cached-but-free prefix blocks count as free)."""
    s = aeng.stats()
    return s.num_blocks - s.num_free_blocks


def wait_idle_and_free(aeng: AsyncEngine) -> None:
    """Waits until nothing is in flight, then until every KV block is back in the pool (the
    stats snapshot is taken at the end of a loop iteration, so it may lag by one)."""
    wait_for(lambda: is_idle(aeng), f"engine idle ({aeng.stats()})")
    wait_for(lambda: leaked_blocks(aeng) == 0, f"all KV blocks free ({aeng.stats()})")


def gauges(url: str) -> dict[str, float]:
    """The unlabelled samples of a server's /metrics (gauges and totals), by sample name."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=HANG_S).text
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if not s.labels
    }


def live_threads() -> set[str]:
    return {f"{t.name}#{t.ident}" for t in threading.enumerate()}


def loop_tasks(loop: asyncio.AbstractEventLoop) -> set[asyncio.Task]:
    """Tasks alive on another thread's loop (read from that loop, so the set is consistent)."""

    async def snapshot() -> set[asyncio.Task]:
        me = asyncio.current_task()
        return {t for t in asyncio.all_tasks() if t is not me and not t.done()}

    return asyncio.run_coroutine_threadsafe(snapshot(), loop).result(HANG_S)


# ---- `appliance serve` as a subprocess ------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServeProcess:
    """A running `appliance serve` (JSON logs on stderr, parsed as they arrive)."""

    proc: Any  # subprocess.Popen
    records: list[dict]
    ports: dict[str, int]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def logged(self, msg: str) -> list[dict]:
        return [r for r in list(self.records) if r.get("msg") == msg]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def tiny_serve_sets(model_dir: Path, grpc: bool = True, **overrides: Any) -> list[str]:
    """`--set` arguments for the tiny checkpoint on free ports, JSON logs, the Responses
    store in memory (nothing written under the user's cache directory)."""
    sets = {
        "model.path": str(model_dir), "model.max_model_len": 128, "model.served_name": "tiny",
        "cache.num_kv_blocks": 256, "runtime.device": "cpu", "runtime.num_threads": 1,
        "server.http_port": 0, "server.grpc_port": 0 if grpc else "null",
        "telemetry.log_format": "json", "responses.store_path": ":memory:", **overrides,
    }  # fmt: skip
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def spawn_serve(
    args: list[str], module: str = "appliance", timeout: float = HANG_S, records_max: int = 5000
) -> ServeProcess:
    """Starts `python -m <module> <args>` and waits until HTTP (and gRPC, if enabled) listen.

    `records_max` bounds the kept log records (a soak logs a line per request)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    # The repo first, then what the caller had (the GPU check's carried packages live there).
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    sp = ServeProcess(proc, [], {})
    grpc_on = not any(a == "server.grpc_port=null" for a in args)
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                rec = json.loads(line)
            except ValueError:
                rec = {"msg": "raw", "line": line}
            sp.records.append(rec)
            if len(sp.records) > records_max:
                del sp.records[: records_max // 2]
            if rec.get("msg") in ("http listening", "grpc listening"):
                sp.ports[rec["msg"].split()[0]] = rec["port"]
                if len(sp.ports) == 1 + grpc_on:
                    ready.set()
        ready.set()  # the process ended: let the caller see why

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout) or proc.poll() is not None:
        sp.kill()
        raise RuntimeError(f"server did not start: {sp.records[-10:]}")
    return sp
