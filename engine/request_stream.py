"""What a caller of AsyncEngine holds: one request's stream of deltas, and its outcome.

This is the event-loop side of AsyncEngine, kept apart from the engine thread so that a
frontend (HTTP and gRPC alike) can see what it consumes, and finish listeners what they
get, without reading the loop. It imports nothing from `engine.async_engine`: the engine
thread fills a stream only through `loop.call_soon_threadsafe(stream.put, ...)` (or
`stream.fail`), and the stream asks for an abort through the callback it was given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.core.policy.tenant import DEFAULT_TENANT_NAME
from engine.errors import UnsatisfiableRequestError
from engine.output.request_output import (
    OutputAccumulator,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
    SampleDelta,
)

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
    tenant: str = DEFAULT_TENANT_NAME  # whose share it ran on (metrics' `tenant` label)

    @classmethod
    def of(
        cls,
        request_id: str,
        reason: str | None,
        total: OutputAccumulator,
        tenant: str | None = None,
    ) -> FinishedRequest:
        """From the sum of the request's deltas, built once; `reason` None: the request's own
        outcome (stop, length, error)."""
        o = total.output()
        return cls(
            request_id=request_id,
            finish_reason=reason or request_outcome(o),
            num_prompt_tokens=len(o.prompt_token_ids),
            num_generation_tokens=total.num_output_tokens,
            metrics=o.metrics,
            output=o,
            tenant=tenant or DEFAULT_TENANT_NAME,
        )


@dataclass(frozen=True)
class TokenCounts:
    """A request's token usage so far (what its stream has handed to the consumer)."""

    prompt_tokens: int
    completion_tokens: int  # over all samples
    cached_tokens: int  # prompt tokens read from the prefix cache


def request_outcome(out: RequestOutput) -> str:
    """One finish reason for the whole request (the worst of its samples')."""
    if out.error:
        return "error"
    reasons = {o.finish_reason or "abort" for o in out.outputs}
    return next((r for r in _OUTCOME_ORDER if r in reasons), "stop")


def sole_choice_error(outs: Sequence[RequestOutput]) -> UnsatisfiableRequestError | None:
    """The one rule for a sample that ended by its own constraints (`SampleError`), for a
    whole answer (a non-streamed reply, a unary rpc): when the answer has exactly one choice
    and that choice failed, the answer is its error (HTTP 400 / INVALID_ARGUMENT naming the
    field); with several choices each failed one carries its own error and the answer
    succeeds, as OpenAI returns `n` choices independently. Streams mark the failed choice
    and go on (docs/serving.md, "Errors")."""
    choices = [c for o in outs for c in o.outputs]
    if len(choices) != 1 or choices[0].error is None:
        return None
    err = choices[0].error
    return UnsatisfiableRequestError(err.message, err.param)


class RequestStream:
    """Async iterator over one request's `RequestDelta`s; `abort()` cancels it.

    A consumer that falls behind loses nothing: the deltas it has not read yet are
    coalesced per choice (tokens, text and logprobs of a sample concatenated in order, its
    finish kept), so its next read returns them all as one delta. Each choice's
    `finish_reason` arrives exactly once: the engine reports it once, and an aborted stream
    ends with one delta giving "abort" to every choice that had not finished.

    The stream also sums what it has handed out: `counts()` is the usage so far, and
    `output()` (or `result()`, which first reads to the end) the whole answer, built once.
    """

    def __init__(
        self,
        request_id: str,
        n: int,
        num_prompt_tokens: int,
        loop: asyncio.AbstractEventLoop,
        on_abort: Callable[[str], None],
    ):
        self.request_id = request_id
        self.n = n
        self.num_prompt_tokens = num_prompt_tokens
        self.loop = loop  # the engine thread delivers on this loop
        self._on_abort = on_abort
        # Delivered, not read yet: the one delta as it came, or several coalesced.
        self._pending: RequestDelta | OutputAccumulator | None = None
        self._seen = OutputAccumulator(request_id, n)  # everything read so far
        self._exc: BaseException | None = None
        self._aborted = False
        self._event = asyncio.Event()
        self.finished = False  # nothing more will be read: finished, failed or aborted

    # ---- the engine's side (runs on `loop`) ---------------------------------------------------
    def put(self, delta: RequestDelta) -> None:
        """One step's delta for this request; coalesced with any the consumer has not read."""
        if self._aborted:
            return
        pending = self._pending
        if pending is None:  # the usual case: the consumer keeps up, nothing to coalesce
            self._pending = delta
        else:
            if isinstance(pending, RequestDelta):
                self._pending = _accumulate(self.request_id, pending)
            self._pending.add(delta)  # type: ignore[union-attr]
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        """The request ended in the engine with `exc` (raised once the pending deltas are read)."""
        self._exc = exc
        self._event.set()

    # ---- the consumer's side -----------------------------------------------------------------
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        while not self.finished:
            if self._pending is not None or self._aborted:
                return self._take()
            if self._exc is not None:
                self.finished = True
                raise self._exc
            self._event.clear()
            await self._event.wait()
        raise StopAsyncIteration

    def _take(self) -> RequestDelta:
        pending, self._pending = self._pending, None
        if self._aborted:
            if isinstance(pending, RequestDelta):
                pending = _accumulate(self.request_id, pending)
            pending = pending or OutputAccumulator(self.request_id)
            done = {**self._seen.finish_reasons(), **pending.finish_reasons()}
            rest = [SampleDelta(i, finish_reason="abort") for i in range(self.n) if i not in done]
            pending.add(RequestDelta(self.request_id, rest, finished=True))
        assert pending is not None
        delta = pending if isinstance(pending, RequestDelta) else pending.delta()
        self._seen.add(delta)
        self.finished = delta.finished
        return delta

    async def result(self) -> RequestOutput:
        """Reads the stream to its end; the whole output (raises what the engine raised).
        Cancelling the caller aborts the request."""
        try:
            async for _ in self:
                pass
        finally:
            self.abort()
        return self.output()

    def output(self) -> RequestOutput:
        """Everything read so far as one output (copies it all: call it once, at the end)."""
        return self._seen.output()

    def counts(self) -> TokenCounts:
        """Token usage of what has been read so far (cheap: call it per chunk)."""
        metrics = self._seen.metrics
        return TokenCounts(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self._seen.num_output_tokens,
            cached_tokens=metrics.num_cached_tokens if metrics is not None else 0,
        )

    def finish_reasons(self) -> list[str | None]:
        """Each choice's finish reason as read so far (None: still running)."""
        done = self._seen.finish_reasons()
        return [done.get(i) for i in range(self.n)]

    @property
    def aborted(self) -> bool:
        """The consumer aborted the stream before it finished."""
        return self._aborted

    def abort(self) -> None:
        """Cancels the request in the engine unless it already finished. Idempotent.

        A consumer still reading gets the deltas delivered before the abort, then one last
        delta that finishes every unfinished choice with "abort"."""
        if not self.finished and not self._aborted:
            self._aborted = True
            self._on_abort(self.request_id)
            self._event.set()


def _accumulate(request_id: str, delta: RequestDelta) -> OutputAccumulator:
    acc = OutputAccumulator(request_id)
    acc.add(delta)
    return acc
