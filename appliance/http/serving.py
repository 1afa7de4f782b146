"""Plumbing shared by the generation routes: app state, reading the request, submitting,
merging, disconnects, the JSON or SSE answer and the closing log line.

Cancellation is the point of most of this module: whatever way a request ends early (the
client disconnects mid-stream or while waiting for a non-streamed answer, the server shuts
down, one of several prompts fails), every `RequestStream` it opened is aborted, so the
engine frees the request's KV blocks within one step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from appliance.adapters import AdapterRegistry, shown_name
from appliance.config import ServerConfig
from appliance.http import convert
from appliance.http.body import check_content_type, parse_json, read_body
from appliance.http.errors import UNAVAILABLE, APIError, from_engine_error
from appliance.http.protocol import (
    CompletionEnvelope,
    ResponseModel,
    SamplingFields,
    StreamOptions,
    UsageInfo,
)
from appliance.http.tracing_hook import HttpRequestTracer
from appliance.metrics import ApplianceMetrics
from appliance.responses.store import ResponseStore
from appliance.tenancy import Caller, Tenancy
from engine.async_engine import AsyncEngine
from engine.lora_request import LoRARequest
from engine.output.request_output import RequestDelta, RequestOutput
from engine.request_stream import RequestStream, sole_choice_error
from engine.sampling_params import SamplingParams

logger = logging.getLogger("appliance.http")

_TOKEN_CACHE_MAX = 200_000


@dataclass
class AppState:
    """Everything a route needs, hung on `app.state.appliance`."""

    aeng: AsyncEngine
    server: ServerConfig
    metrics: ApplianceMetrics
    version: str
    # The adapters a request's `model` may name (an empty registry when lora is off).
    adapters: AdapterRegistry
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    # Request spans (None when tracing is off): see appliance/http/tracing_hook.py.
    tracer: HttpRequestTracer | None = None
    # Stored responses of /v1/responses (build_app makes an in-memory one when none is given).
    responses: ResponseStore | None = None
    # API key -> tenant (built from `server` when not given): see appliance/tenancy.py.
    tenancy: Tenancy | None = None
    _token_strs: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tenancy is None:
            self.tenancy = Tenancy(self.server)

    @property
    def model_name(self) -> str:
        return self.aeng.model_name

    def resolve_model(self, name: str | None) -> LoRARequest | None:
        """What a request's `model` selects: None for the base model (also when the field is
        absent), else a loaded adapter; anything else is a 404 model_not_found."""
        if name is None or name == self.model_name:
            return None
        lora = self.adapters.get(name)
        if lora is None:
            served = f"`{self.model_name}`"
            if self.adapters.enabled:
                served += " and the adapters GET /v1/models lists"
            raise APIError(
                404,
                f"The model `{shown_name(name)}` does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        return lora

    def response_model(self, name: str | None) -> str:
        """The `model` a response names: the one the request asked for (an adapter's name,
        as vLLM answers), else the base model's."""
        return name or self.model_name

    def token_str(self, token_id: int) -> str:
        """A token's text for logprobs (cached: the same ids come back constantly)."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.aeng.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_strs) < _TOKEN_CACHE_MAX:
                self._token_strs[token_id] = s
        return s


def state_of(request: Request) -> AppState:
    return request.app.state.appliance


R = TypeVar("R", bound=SamplingFields)
E = TypeVar("E", bound=CompletionEnvelope)


@dataclass
class Begun(Generic[R]):
    """A generation request as read by `begin`."""

    arrival: float
    state: AppState
    req: R
    params: SamplingParams
    lora: LoRARequest | None
    # The request's whole input (its body's bytes): what decides whether the work that
    # grows with it (parsing, rendering, tokenizing, compiling) runs off the event loop.
    size: int

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` inline for a small request, on a worker thread for a large one."""
        return await self.state.aeng.offload_if_large(self.size, fn, *args)


async def begin(request: Request, model: type[R]) -> Begun[R]:
    """How every generation route starts (shared so they check in the same order): arrival
    time, app state, the validated body, the model name (and the adapter it selects), then
    the sampling parameters; the body's parsing and conversion off the event loop when the
    body is large."""
    arrival = time.monotonic()
    state = state_of(request)
    check_content_type(request)
    raw = await read_body(request, state.server.max_request_body, state.server.body_timeout_s)

    def parse() -> tuple[R, SamplingParams, LoRARequest | None]:
        req = parse_json(raw, model)
        lora = state.resolve_model(req.model)
        return req, convert.sampling_params(req), lora  # type: ignore[arg-type]

    req, params, lora = await state.aeng.offload_if_large(len(raw), parse)
    return Begun(arrival, state, req, params, lora, len(raw))


async def submit(
    request: Request,
    begun: Begun,
    prompts: Sequence[str | list[int]],
    base_id: str,
    operation: str,
    *,
    map_param: Callable[[str | None], str | None] = lambda p: p,
    cache_salt: tuple[str, ...] = (),
    caller: Caller | None = None,
) -> list[RequestStream]:
    """Adds one engine request per prompt (run with the adapter the request selected):
    every prompt is validated before any is queued, and all are queued at once
    (`AsyncEngine.add_requests`); on any failure none stays queued. `caller`
    (appliance/http/caller.py): the tenant and deadline every prompt runs under, and the
    tenant's cache salt.

    The client is watched meanwhile: if it leaves before the prompts are queued, they are
    aborted (or never queued) and the request ends as a 499 (`ClientDisconnect`), however
    long the preparation takes. With tracing on, each engine request is recorded as a span
    of GenAI `operation`, joined to the caller's `traceparent`, when it ends."""
    state, params, lora = begun.state, begun.params, begun.lora
    if state.shutting_down:
        # Draining after SIGTERM: uvicorn closes its listener only on its next tick, so a
        # connection accepted meanwhile must still be refused, not handed new work.
        raise APIError(503, "the server is shutting down", type_=UNAVAILABLE, code="shutting_down")
    rids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
    if state.tracer is not None:
        for rid in rids:
            state.tracer.register(rid, dict(request.headers), params, operation)
    try:
        with state.adapters.admitting(lora) if lora else nullcontext():
            adding = state.aeng.add_requests(
                prompts, params, rids, priority=begun.req.priority, arrival_time=begun.arrival,
                cache_salt=(*caller.salt, *cache_salt) if caller else cache_salt,
                lora_request=lora, input_size=begun.size,
                tenant=caller.tenant if caller else None,
                deadline=caller.deadline if caller else None,
            )  # fmt: skip
            streams = await until_disconnect(request, adding, ())
    except BaseException as e:
        if state.tracer is not None:
            for rid in rids:
                state.tracer.forget(rid)
        if isinstance(e, ClientGone):
            raise ClientDisconnect() from None
        if isinstance(e, Exception):
            raise convert.client_error(e, map_param) from None
        raise
    if lora is not None:
        for _ in streams:
            state.adapters.count_request(lora)
    return streams


def abort_all(streams: Sequence[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(prompt index, delta) from several streams as they arrive; engine errors -> APIError."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    queue.put_nowait((i, out, None))
            except Exception as e:
                queue.put_nowait((i, None, e))
            queue.put_nowait((i, None, StopAsyncIteration()))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, out, exc = await queue.get()
                if isinstance(exc, StopAsyncIteration):
                    remaining -= 1
                elif exc is not None:
                    raise exc
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()
    except APIError:
        raise
    except Exception as e:
        raise from_engine_error(e) from None
    finally:
        abort_all(streams)


async def collect(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The whole output of every stream, built once each streams ends."""
    async for _ in merged(streams):
        pass
    return [s.output() for s in streams]


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, coro: Any, streams: Sequence[RequestStream]) -> Any:
    """Runs `coro`; if the client goes away first, aborts `streams` and raises ClientGone."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            abort_all(streams)
        watcher.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


class ClientGone(Exception):
    """The client disconnected before the answer was ready (nothing can be sent)."""


async def respond(
    request: Request,
    rid: str,
    streams: Sequence[RequestStream],
    events: AsyncIterator[str] | None,
    finish: Callable[[list[RequestOutput]], ResponseModel],
    map_param: Callable[[str | None], str | None] = lambda p: p,
) -> Response:
    """How every generation route answers once its requests are in the engine, shared so the
    routes cannot differ in it: `events` as SSE when streaming; otherwise the final outputs,
    turned into the JSON body by `finish` (which also logs), or a bare 499 if the client left
    before them. A whole answer whose only choice ended by its own constraints is that
    choice's error (`sole_choice_error`: a 400 naming the field, by `map_param`)."""
    if events is not None:
        return SSEResponse(events, rid)
    try:
        finals = await until_disconnect(request, collect(streams), streams)
    except ClientGone:
        return Response(status_code=499)
    failed = sole_choice_error(finals)
    if failed is not None:
        raise convert.client_error(failed, map_param)
    body = finish(finals)
    return JSONResponse(body.model_dump(mode="json"), headers={"X-Request-Id": rid})


def log_done(
    state: AppState,
    rid: str,
    finals: Sequence[RequestOutput],
    what: str,
    prompt_key: str,
    prompt: Callable[[], Any],
) -> None:
    """The one log line a finished generation request writes (chat and text alike); the
    prompt (`prompt()`, built only then) and outputs only with `server.log_prompts`."""
    fields: dict = {
        "request_id": rid,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in finals),
        "completion_tokens": sum(len(c.token_ids) for o in finals for c in o.outputs),
        "finish_reasons": ",".join(str(c.finish_reason) for o in finals for c in o.outputs),
    }
    if state.server.log_prompts:
        fields[prompt_key] = prompt()
        fields["output"] = [c.text for o in finals for c in o.outputs]
    logger.info(f"{what} done", extra={"fields": fields})


class SSEResponse(Response):
    """Server-sent events that stop, and close their source, the moment the client leaves.

    Starlette's StreamingResponse only notices a disconnect when a send fails (ASGI spec
    2.4), which never happens while a request waits in the queue; here a watcher on
    `receive` cancels the stream at once, and the body iterator is always closed, which
    aborts the engine request. A stream the server cuts (its shutdown grace ended) still
    ends as a whole body: an error event, then `[DONE]`.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str], request_id: str):
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self.init_headers(
            {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request_id}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        ended = False
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    await _wait_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    async for chunk in self.body_iterator:
                        await _send_chunk(send, chunk.encode())
                    ended = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the client went away during a send
                    pass
                tg.cancel_scope.cancel()
        except asyncio.CancelledError:
            # The server cut the stream (the shutdown grace ended): end the body properly,
            # with an error event and [DONE], rather than as a truncated chunked body.
            if not ended:
                await _send_chunk(send, _CUT_EVENT, more_body=False)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def sse(data: str) -> str:
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")

# What a stream still running when the shutdown grace ends sends last.
_CUT_EVENT = (
    sse(
        json.dumps(
            APIError(
                503,
                "the server shut down before this stream finished",
                UNAVAILABLE,
                code="shutting_down",
            ).body()
        )
    )
    + SSE_DONE
).encode()


async def _send_chunk(send: Send, body: bytes, more_body: bool = True) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more_body})


def whole_body(cls: type[E], rid: str, model: str, choices: list, usage: UsageInfo) -> E:
    """A non-streamed answer's body (chat or text), `created` now."""
    return cls(id=rid, created=int(time.time()), model=model, choices=choices, usage=usage)


class ChunkWriter:
    """The SSE events of one streamed answer, chat or text: the same envelope rules for both.

    The choices come from the engine's deltas as they are (each piece of text, token and
    logprob once; each choice's finish_reason once), so nothing here remembers what was
    sent, except each choice's text length for the legacy logprobs' `text_offset`.

    Each chunk names its `object` explicitly (chunks are dumped with exclude_unset). With
    `stream_options.include_usage` each chunk carries `"usage": null` and a last chunk with
    no choices the totals; with `continuous_usage_stats` as well, each chunk carries the
    usage so far instead (as vLLM does). `created` is fixed when the stream starts.
    """

    def __init__(
        self,
        cls: type[CompletionEnvelope],
        rid: str,
        model: str,
        stream_options: StreamOptions | None,
        streams: Sequence[RequestStream],
    ):
        self.cls = cls
        self.rid = rid
        self.created = int(time.time())
        self.model = model
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.continuous_usage = self.include_usage and bool(
            stream_options and stream_options.continuous_usage_stats
        )
        self._streams = streams
        self._completion_tokens = 0  # in the deltas taken so far
        self._chars: dict[int, int] = {}

    def text_offset(self, index: int, text: str) -> int:
        """Where `text`, the next piece of choice `index`, starts in that choice's text."""
        start = self._chars.get(index, 0)
        self._chars[index] = start + len(text)
        return start

    def _body(self, choices: list, **kw: Any) -> CompletionEnvelope:
        obj = self.cls.model_fields["object"].default
        return self.cls(
            object=obj, id=self.rid, created=self.created, model=self.model, choices=choices, **kw
        )

    def took(self, delta: RequestDelta) -> None:
        """Counts a delta's tokens into the usage so far (tokens with no text yet too)."""
        self._completion_tokens += sum(len(c.token_ids) for c in delta.outputs)

    def chunk(self, choices: list) -> str:
        body = self._body(choices)
        if self.continuous_usage:
            body.usage = self._usage_so_far()
        elif self.include_usage:
            body.usage = None
        return sse(body.model_dump_json(exclude_unset=True))

    def _usage_so_far(self) -> UsageInfo:
        prompt = sum(s.num_prompt_tokens for s in self._streams)
        cached = sum(s.counts().cached_tokens for s in self._streams)
        return convert.usage_info(prompt, self._completion_tokens, cached)

    def usage(self, usage: UsageInfo) -> str:
        return sse(self._body([], usage=usage).model_dump_json())
