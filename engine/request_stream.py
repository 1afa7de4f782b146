"""What a caller of AsyncEngine holds: one request's stream of outputs, and its outcome.

These are the event-loop side of AsyncEngine, kept apart from the engine thread so that a
frontend can see what it consumes (and finish listeners what they get) without reading the
loop. The engine thread fills a stream only through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.output.request_output import RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

# Worst-first order used to give an n > 1 request a single outcome.
_OUTCOME_ORDER = ("error", "abort", "length", "stop")


@dataclass
class FinishedRequest:
    """What finish listeners (metrics, tracing) get once per request, on the engine thread."""

    request_id: str
    finish_reason: str  # stop | length | abort | error
    num_prompt_tokens: int
    num_generation_tokens: int
    metrics: RequestMetrics | None
    output: RequestOutput | None


def request_outcome(out: RequestOutput) -> str:
    """One finish reason for the whole request (the worst of its samples')."""
    if out.error:
        return "error"
    reasons = {o.finish_reason or "abort" for o in out.outputs}
    return next((r for r in _OUTCOME_ORDER if r in reasons), "stop")


class RequestStream:
    """Async iterator over one request's cumulative outputs; `abort()` cancels it.

    Filled from the engine thread through `loop.call_soon_threadsafe`; consumed on `loop`.
    """

    def __init__(self, request_id: str, owner: AsyncEngine, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._latest: RequestOutput | None = None
        self._exc: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False
        # Engine-thread side: newest output delivered (for abort accounting).
        self.last_output: RequestOutput | None = None

    def _put(self, out: RequestOutput) -> None:
        self._latest = out
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._exc = exc
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.finished:
            if self._latest is not None:
                out, self._latest = self._latest, None
                self.finished = out.finished
                return out
            if self._exc is not None:
                self.finished = True
                raise self._exc
            self._event.clear()
            await self._event.wait()
        raise StopAsyncIteration

    def abort(self) -> None:
        """Cancels the request in the engine unless it already finished. Idempotent."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


def _ack(fut: asyncio.Future, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)


def _run_callbacks(items: list[tuple[Callable, Any, Any]]) -> None:
    for fn, target, arg in items:
        fn(target, arg)
