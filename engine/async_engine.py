"""AsyncEngine: the engine loop on its own thread, one async iterator per request.

The frontends (HTTP, gRPC) run on an asyncio event loop; `LLMEngine.step()` is blocking
compute. So the loop that steps runs on a dedicated daemon thread::

    event loop(s)                                engine thread
    ─────────────                                ─────────────
    add_request(): prepare_request (validate,
      tokenize) -> inbox ────────────────────▶  drain inbox: add_prepared / abort
      await ack ◀──────── call_soon_threadsafe ─   (ack: added, or QueueFull / invalid)
    async for delta in stream ◀─ call_soon_threadsafe ─ step() -> RequestDeltas
    stream closed / cancelled -> abort ───────▶  engine.abort (blocks freed before next step)

The thread sleeps on a Condition while there is no work. The engine emits per-step deltas
(only what is new), so a stream's cost is linear in its length; a slow consumer gets the
deltas it has not read coalesced into one (see `RequestStream`), never dropped. Any number
of frontends, on any number of event loops, may share one AsyncEngine. If a step raises,
the requests in it fail (their iterators raise `RequestFailedError`; requests waiting
outside the failed step carry on) and the loop carries on; after `max_consecutive_failures`
failing steps in a row the engine is declared dead (`is_healthy` False, `EngineDeadError`).
A step that raises `EngineDeadError` itself (a tensor-parallel worker died or hung) kills the
engine at once, failing every request with its message; so does the engine's
`fatal_error` turning non-None between steps (health goes red while idle).

A step that never returns (a wedged device, a deadlock in a kernel) cannot be interrupted
from Python, so the watchdog is passive: with `step_timeout_s` set, a step running longer
than that makes the engine unhealthy and refuses new requests, and whoever supervises the
process (`appliance serve`) exits so that it is restarted.

The stream each caller holds (`RequestStream`) and what finish listeners get
(`FinishedRequest`) live in `engine.request_stream`; what crosses the thread boundary (inbox
items, deliveries, pending adapter removals) in `engine.engine_inbox`. What this module
needs of the engine it drives is the `SteppedEngine` protocol (LLMEngine, or a fake).

LoRA adapters: `add_lora` (and `add_request` for an adapter not loaded yet) reads the files
on a worker thread, never on the event loop or the engine thread. `remove_lora` goes
through the inbox like an abort: new requests for the adapter are refused at once, and the
call returns when the last request using it has left (they finish untouched).

The engine thread's side (the loop, the inbox, delivery, failed steps) is the mixin
`EngineLoop` in engine/engine_loop.py. This module imports no HTTP code and no torch (the
LLMEngine is passed in or built lazily).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine.core.policy.tenant import Tenant
from engine.engine_inbox import (
    Abort,
    Add,
    InFlight,
    PendingRemovals,
    RemoveLoRA,
)
from engine.engine_loop import EngineLoop
from engine.errors import (
    EngineDeadError,
)
from engine.loop_thread import BuiltOnThread
from engine.lora_request import LoRARequest
from engine.output.request_output import RequestDelta, RequestOutput
from engine.pooling_params import PoolingParams
from engine.request_stream import (  # FinishedRequest and RequestStream are re-exported
    FinishedRequest,
    RequestStream,
)
from engine.sampling_params import SamplingParams
from engine.stepped_engine import PreparedLike, SteppedEngine

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm_engine import EngineStats
    from engine.worker.status import AcceleratorStatus

logger = logging.getLogger(__name__)

# Prompts (characters, or token ids) longer than this are tokenized off the event loop,
# unless the caller sets its own threshold (`server.offload_prompt_chars`).
DEFAULT_OFFLOAD_PROMPT_CHARS = 8192


class AsyncEngine(EngineLoop):
    """Owns an LLMEngine and the thread that steps it. See the module docstring."""

    def __init__(
        self,
        engine: SteppedEngine,
        *,
        max_consecutive_failures: int = 3,
        step_timeout_s: float | None = None,
        offload_prompt_chars: int = DEFAULT_OFFLOAD_PROMPT_CHARS,
        _loop: BuiltOnThread[Any] | None = None,
    ):
        """`_loop` (from `from_config`): the thread `engine` was built on, which becomes the
        engine loop's thread (see engine/loop_thread.py for why)."""
        self.engine = engine
        self.max_consecutive_failures = max_consecutive_failures
        self.step_timeout_s = step_timeout_s
        self.offload_prompt_chars = offload_prompt_chars
        self._step_started: float | None = None  # monotonic start of the running step
        self._cond = threading.Condition()
        self._inbox: list[Add | Abort | RemoveLoRA] = []
        self._pending = 0  # adds in the inbox, not yet handed to the engine
        self._streams: dict[str, InFlight] = {}  # engine thread writes; others read len
        self._listeners: list[Callable[[FinishedRequest], None]] = []
        self._removals = PendingRemovals(engine)  # engine thread: adapters still in use
        self._stats = engine.stats()
        self._accepting = True
        self._stopping = False
        self._dead: str | None = None
        self._consecutive_failures = 0
        self.num_steps = 0
        self.num_failed_steps = 0
        if _loop is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        else:
            self._thread = _loop.thread
        engine.set_wakeup(self._wake)  # background work (KV tier rescans) wakes the loop
        if _loop is None:
            self._thread.start()
        else:
            _loop.run(self._run)

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncEngine:
        """Builds the LLMEngine on the thread that will step it (engine/loop_thread.py: a
        model loaded on another thread leaves an OpenMP pool there that halves the speed of
        the stepping thread's kernels on a small CPU)."""
        from engine.llm_engine import LLMEngine

        loop = BuiltOnThread("engine-loop", lambda: LLMEngine(config))
        try:
            return cls(loop.value, _loop=loop, **kwargs)
        except BaseException:
            loop.run(None)  # the thread exits instead of waiting for a loop forever
            raise

    # ---- what the frontends may read ------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def task(self) -> str:
        """generate or embed (an engine without the attribute generates)."""
        return getattr(self.engine, "task", "generate")

    @property
    def embedding_size(self) -> int | None:
        """An embedding model's vector width; None for a generation model."""
        return getattr(self.engine, "embedding_size", None)

    @property
    def is_healthy(self) -> bool:
        return (
            self._dead is None
            and self._thread.is_alive()
            and self._hung_for() is None
            and self.engine.fatal_error is None
        )

    @property
    def accelerator(self) -> AcceleratorStatus:
        """The attention backend and decode graphs the engine runs with (fixed at start-up)."""
        return self.engine.accelerator

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_healthy

    @property
    def dead_reason(self) -> str | None:
        if self._dead is not None:
            return self._dead
        hung = self._hung_for()
        if hung is not None:
            return f"an engine step has been running for {hung:.0f}s (step_timeout_s)"
        return self.engine.fatal_error

    def _hung_for(self) -> float | None:
        """Seconds the current step has run, if that is beyond `step_timeout_s`."""
        started = self._step_started
        if self.step_timeout_s is None or started is None:
            return None
        age = time.monotonic() - started
        return age if age > self.step_timeout_s else None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + self._pending

    def stats(self) -> EngineStats:
        """The engine's counters as of the end of the latest loop iteration."""
        return self._stats

    def add_finish_listener(self, fn: Callable[[FinishedRequest], None]) -> None:
        """`fn` runs on the engine thread once per finished or aborted request; keep it short."""
        self._listeners.append(fn)

    async def offload_if_large(
        self, size: int, fn: Callable[..., Any], *args: Any, **kw: Any
    ) -> Any:
        """Runs `fn` inline when `size` (characters, or token ids) is at most
        `offload_prompt_chars`, else in a worker thread, so that one huge prompt cannot stall
        every other stream on the event loop. The one threshold for every frontend."""
        if size > self.offload_prompt_chars:
            return await asyncio.to_thread(fn, *args, **kw)
        return fn(*args, **kw)

    # ---- requests -------------------------------------------------------------------------
    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | tuple[str, ...] | None = None,
        lora_request: LoRARequest | None = None,
        tenant: Tenant | None = None,
        deadline: float | None = None,
        input_size: int | None = None,
    ) -> RequestStream:
        """Validates, queues and returns the request's stream once the engine holds it.
        Only requests with equal `cache_salt`s (and the same adapter) share cached prompt
        blocks. `lora_request`: the LoRA adapter to run (read from disk on a worker thread
        when not loaded yet). `tenant`: whose share it runs on (the frontends map API keys
        to tenants); `deadline`: the time.monotonic() by which it must finish, after which
        the engine drops it (waiting) or stops it (running) and the stream raises
        `DeadlineExceededError`. `input_size`: see `prepare_requests`.

        Raises InvalidRequestError (never servable; LoRAError for the adapter),
        QueueFullError (try later) or EngineDeadError before anything is streamed, so a
        frontend can still pick a status.
        """
        (stream,) = await self.add_requests(
            [prompt], params, [request_id or uuid.uuid4().hex], priority=priority,
            arrival_time=arrival_time, cache_salt=cache_salt, lora_request=lora_request,
            input_size=input_size, tenant=tenant, deadline=deadline,
        )  # fmt: skip
        return stream

    async def prepare_requests(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | PoolingParams,
        request_ids: Sequence[str],
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | tuple[str, ...] | None = None,
        lora_request: LoRARequest | None = None,
        input_size: int | None = None,
        tenant: Tenant | None = None,
        deadline: float | None = None,
    ) -> list[PreparedLike]:
        """Validates and tokenizes every prompt (`LLMEngine.prepare_request`: lengths, token
        ids, adapter, grammar) and queues nothing: the one validation of the generation and
        the render routes. Raises the first prompt's InvalidRequestError.

        Off the event loop, on one worker thread for all prompts, when the work may block or
        grows with the input: a constraint to compile (it may wait for seconds), an adapter
        to read from disk, or an input over `offload_prompt_chars`. `input_size` is the
        request's whole input as the frontend received it (body bytes: every prompt, tool,
        schema and message), else the prompts' total length."""
        self._check_accepting()
        arrival = arrival_time if arrival_time is not None else time.monotonic()

        def prepare_all() -> list[PreparedLike]:
            return [
                self.engine.prepare_request(
                    rid,
                    prompt,
                    params,
                    priority=priority,
                    arrival_time=arrival,
                    cache_salt=cache_salt,
                    lora_request=lora_request,
                    tenant=tenant,
                    deadline=deadline,
                )  # fmt: skip
                for rid, prompt in zip(request_ids, prompts, strict=True)
            ]

        size = input_size if input_size is not None else sum(len(p) for p in prompts)
        blocking = getattr(params, "structured_outputs", None) is not None or (
            lora_request is not None and not self.engine.is_lora_loaded(lora_request)
        )
        if blocking:
            return await asyncio.to_thread(prepare_all)
        return await self.offload_if_large(size, prepare_all)

    async def add_requests(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | PoolingParams,
        request_ids: Sequence[str],
        **kw: Any,
    ) -> list[RequestStream]:
        """Several prompts of one request (`prepare_requests` takes the same keywords): every
        prompt is validated before any is queued, then all are handed to the engine at once
        (one inbox handoff, acknowledged together), so a request with many prompts is
        queued in one engine-loop iteration, not one per prompt. On any refusal, or if the
        caller is cancelled, the prompts already queued are aborted; raises as
        `add_request` does."""
        prepared = await self.prepare_requests(prompts, params, request_ids, **kw)
        loop = asyncio.get_running_loop()
        n = params.n if isinstance(params, SamplingParams) else 1
        tenant = kw.get("tenant")
        items = [
            Add(p, RequestStream(p.request_id, n, len(p.prompt_token_ids), loop, self.abort),
                loop.create_future(), tenant.name if tenant is not None else None)
            for p in prepared
        ]  # fmt: skip
        with self._cond:
            self._check_accepting()
            self._pending += len(items)
            self._inbox.extend(items)
            self._cond.notify()
        try:
            acks = await asyncio.gather(*(it.ack for it in items), return_exceptions=True)
        except asyncio.CancelledError:
            for it in items:
                it.stream.abort()
            raise
        failed = next((a for a in acks if isinstance(a, BaseException)), None)
        if failed is not None:
            for it in items:
                it.stream.abort()
            raise failed
        return [it.stream for it in items]

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        tenant: Tenant | None = None,
        deadline: float | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Yields the request's deltas until it finishes; closing it aborts the request."""
        stream = await self.add_request(
            prompt, params, request_id, priority=priority, arrival_time=arrival_time,
            lora_request=lora_request, tenant=tenant, deadline=deadline,
        )  # fmt: skip
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def embed(
        self,
        prompt: str | list[int],
        params: PoolingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> RequestOutput:
        """One input's embedding (an embedding model's `RequestOutput`, its `embedding`
        set). Raises as `add_request` does, or what the engine failed the request with;
        cancelling the caller aborts it."""
        stream = await self.add_request(
            prompt, params, request_id, priority=priority, arrival_time=arrival_time
        )
        return await stream.result()

    def abort(self, request_id: str) -> None:
        """Thread-safe; the engine drops the request (and frees its blocks) before its next step."""
        with self._cond:
            self._inbox.append(Abort(request_id))
            self._cond.notify()

    # ---- LoRA adapters --------------------------------------------------------------------
    async def add_lora(self, lora: LoRARequest) -> None:
        """Reads and checks the adapter on a worker thread; LoRAError names what is wrong.
        Adding the same name and path again does nothing."""
        self._check_accepting()
        await asyncio.to_thread(self.engine.add_lora, lora)

    async def remove_lora(self, lora_name: str) -> None:
        """Refuses new requests for the adapter at once (LoRAError) and returns once no
        request uses it any more; requests already running with it finish untouched.
        LoRANotFoundError when no such adapter is loaded."""
        self._check_accepting()
        loop = asyncio.get_running_loop()
        item = RemoveLoRA(lora_name, loop.create_future(), loop)
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()
        await item.done

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded (those being removed are left out)."""
        return self.engine.list_loras()

    async def shutdown(self, grace_s: float = 0.0, flush_s: float = 0.0) -> None:
        """Stops accepting, lets in-flight requests finish for up to `grace_s`, aborts the rest.
        `flush_s`: then up to that long writing the KV pool's cached blocks to the disk tier
        (warm restart; skipped when the engine is dead or hung)."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self.num_in_flight and self.is_healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = self.num_in_flight
        with self._cond:
            self._inbox.append(Abort(None, EngineDeadError("the server is shutting down")))
            self._stopping = True
            self._cond.notify()
        # A hung step never returns: do not wait for it (the thread is a daemon).
        await asyncio.to_thread(self._thread.join, 1.0 if self._hung_for() else 30.0)
        stopped = self._dead is None and not self._thread.is_alive()
        if flush_s > 0 and stopped and self.engine.fatal_error is None:
            try:
                await asyncio.to_thread(self.engine.flush_kv_tier, flush_s)
            except Exception:
                logger.exception("kv tier flush failed")
        await asyncio.to_thread(self.engine.close)  # e.g. the tensor-parallel workers
        logger.info("engine loop stopped", extra={"fields": {"aborted": left}})

    def _check_accepting(self) -> None:
        if not self.is_healthy:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason or 'loop exited'}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
