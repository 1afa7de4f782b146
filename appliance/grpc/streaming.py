"""One engine request as the gRPC handlers see it: abortable, consumed as per-sample deltas.

`AsyncEngine.generate` is an async generator that only its consumer can close. The gRPC
services also need to end a request from elsewhere (the `Abort` rpc, the end of a bidi
stream), so `Generation` runs the engine iterator in a task of its own and hands the
handler the newest cumulative output; cancelling that task closes the engine iterator,
which aborts the request in the engine (blocks freed before its next step). Like the
engine's own stream it keeps only the newest output, so a slow client gets fewer, larger
deltas rather than an unbounded backlog.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.core.step_io import TokenLogprobs
from engine.output.request_output import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


class Generation:
    """Runs `engine.generate(...)` in a task; `outputs()` yields its cumulative outputs."""

    def __init__(
        self,
        async_engine: Any,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.params = params
        self.aborted = False
        # The newest output handed to the consumer (for usage, tracing, final deltas).
        self.last: RequestOutput | None = None
        self._latest: RequestOutput | None = None
        self._exc: BaseException | None = None
        self._done = False
        self._event = asyncio.Event()
        iterator = async_engine.generate(prompt, params, request_id, priority=priority)
        self._task = asyncio.create_task(self._pump(iterator), name=f"generate-{request_id}")

    async def _pump(self, iterator: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in iterator:
                self._latest = out
                self._event.set()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # delivered to the consumer, which picks the status
            self._exc = e
        finally:
            self._done = True
            self._event.set()
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Newest cumulative outputs until the request ends; raises what the engine raised."""
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                self.last = out
                yield out
                continue
            if self._done:
                if self._exc is not None and not self.aborted:
                    raise self._exc
                return
            self._event.clear()
            await self._event.wait()

    def abort(self) -> None:
        """Ends the request from any task on this loop; `outputs()` then stops."""
        if not self._done:
            self.aborted = True
            self._task.cancel()

    def close(self) -> None:
        """Handler teardown: aborts the request unless it already finished."""
        if not self._task.done():
            self._task.cancel()


@dataclass
class SampleDelta:
    """What one sample gained since the last delta sent for it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class DeltaTracker:
    """Turns cumulative outputs into per-sample deltas (text grows monotonically)."""

    sent_chars: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def update(self, out: RequestOutput) -> list[SampleDelta]:
        deltas = []
        for c in out.outputs:
            d = self._delta(c)
            if d is not None:
                deltas.append(d)
        return deltas

    def _delta(self, c: CompletionOutput) -> SampleDelta | None:
        if c.index in self.finished:
            return None
        chars = self.sent_chars.get(c.index, 0)
        ntok = self.sent_tokens.get(c.index, 0)
        text, ids = c.text[chars:], c.token_ids[ntok:]
        logprobs = (c.logprobs or [])[ntok:]
        if not text and not ids and c.finish_reason is None:
            return None
        self.sent_chars[c.index] = len(c.text)
        self.sent_tokens[c.index] = len(c.token_ids)
        if c.finish_reason is not None:
            self.finished.add(c.index)
        return SampleDelta(c.index, text, list(ids), list(logprobs), c.finish_reason, c.stop_reason)

    def abort_rest(self, n: int) -> list[SampleDelta]:
        """Final deltas (finish_reason "abort") for the samples that had not finished."""
        rest = [i for i in range(n) if i not in self.finished]
        self.finished.update(rest)
        return [SampleDelta(i, "", [], [], "abort", None) for i in rest]


def usage_counts(out: RequestOutput | None) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens over all samples, prompt tokens from the cache)."""
    if out is None:
        return 0, 0, 0
    cached = out.metrics.num_cached_tokens if out.metrics else 0
    return len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), cached
