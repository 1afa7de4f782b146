"""What the engine returns to its callers: per-step deltas, and whole outputs built from them.

`LLMEngine.step()` returns one `RequestDelta` per request that progressed in that step, and
each holds a `SampleDelta` per sample (choice) that gained something: only the token ids,
text and logprobs that are new since the previous step, so a stream's total cost is linear
in its length (like vLLM's `RequestOutputKind.DELTA`). A sample's `finish_reason` comes
exactly once, on its last delta. The prompt (text, ids, prompt logprobs) rides on a
request's first delta only; `metrics` on its first and last.

Whoever needs the whole answer (a non-streamed HTTP or gRPC reply, `LLM.generate`, beam
search, finish listeners) sums the deltas with one `OutputAccumulator` and builds the
`RequestOutput` / `CompletionOutput` once, at the end. The same summation coalesces the
deltas a slow consumer has not read yet into one (`OutputAccumulator.delta`): tokens, text
and logprobs of the same sample concatenated in order, its finish kept, nothing dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.step_io import TokenLogprobs


@dataclass
class CompletionOutput:
    """One sample's whole output."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None  # the stop string or token id that matched


@dataclass
class RequestMetrics:
    """Engine timestamps (time.monotonic()) for metrics and tracing."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    preempted_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    # When the scheduler ended it because its deadline had passed (None: it did not).
    expired_time: float | None = None


@dataclass
class RequestOutput:
    """One request's whole output (all its samples), built from its deltas."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    # Set when the request failed inside the engine (finish_reason "error").
    error: str | None = None


@dataclass
class SampleDelta:
    """What one sample gained since its previous delta."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # None: logprobs were not asked for
    cumulative_logprob: float | None = None  # the running total, not a difference
    finish_reason: str | None = None  # set once, on the sample's last delta
    stop_reason: int | str | None = None


@dataclass
class RequestDelta:
    """What one request gained in one step (or, coalesced, over several)."""

    request_id: str
    outputs: list[SampleDelta]  # only the samples that gained something, by index
    finished: bool  # every sample has finished: this is the request's last delta
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # on the first delta only
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first delta only
    metrics: RequestMetrics | None = None  # on the first and the last delta
    error: str | None = None  # the request failed inside the engine
    error_is_request: bool = False  # ... because of its own parameters (a 400, not a 500)
    # The exception its stream raises (an engine.errors class: DeadlineExceededError,
    # QueueFullError); None: decided by error_is_request.
    error_type: type[Exception] | None = None


class _SampleSum:
    __slots__ = ("index", "texts", "token_ids", "logprobs", "cumulative_logprob", "finish", "stop")

    def __init__(self, index: int):
        self.index = index
        self.texts: list[str] = []  # joined once, when read: appending stays linear
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.cumulative_logprob: float | None = None
        self.finish: str | None = None
        self.stop: int | str | None = None

    def add(self, d: SampleDelta) -> None:
        if d.text:
            self.texts.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(d.logprobs)
        if d.cumulative_logprob is not None:
            self.cumulative_logprob = d.cumulative_logprob
        if d.finish_reason is not None:
            self.finish, self.stop = d.finish_reason, d.stop_reason

    def text(self) -> str:
        if len(self.texts) > 1:
            self.texts = ["".join(self.texts)]
        return self.texts[0] if self.texts else ""


class OutputAccumulator:
    """Sums one request's deltas, in order; reads them back as one output or one delta.

    `n` samples are reported even if some never produced anything (an abort before they
    started); 0 reports only those that did (enough for coalescing).
    """

    def __init__(self, request_id: str, n: int = 0):
        self.request_id = request_id
        self._samples: dict[int, _SampleSum] = {i: _SampleSum(i) for i in range(n)}
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.metrics: RequestMetrics | None = None
        self.error: str | None = None
        self.error_is_request = False
        self.error_type: type[Exception] | None = None
        self.finished = False
        self.num_output_tokens = 0  # over all samples

    def add(self, delta: RequestDelta) -> None:
        if delta.prompt_token_ids is not None:
            self.prompt, self.prompt_token_ids = delta.prompt, delta.prompt_token_ids
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.metrics is not None:
            self.metrics = delta.metrics
        if delta.error is not None:
            self.error, self.error_is_request = delta.error, delta.error_is_request
            self.error_type = delta.error_type
        self.finished = self.finished or delta.finished
        for d in delta.outputs:
            s = self._samples.get(d.index)
            if s is None:
                s = self._samples[d.index] = _SampleSum(d.index)
            s.add(d)
            self.num_output_tokens += len(d.token_ids)

    def finish_reasons(self) -> dict[int, str]:
        """The samples that have finished, and how."""
        return {i: s.finish for i, s in self._samples.items() if s.finish is not None}

    def output(self) -> RequestOutput:
        """Everything added so far as one `RequestOutput` (copies it all: read it once)."""
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.text(),
                token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=None if s.logprobs is None else list(s.logprobs),
                finish_reason=s.finish,
                stop_reason=s.stop,
            )
            for s in self._sorted()
        ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids or []),
            outputs=outs,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            metrics=self.metrics,
            error=self.error,
        )

    def delta(self) -> RequestDelta:
        """Everything added so far as one `RequestDelta` (the coalesced deltas); the
        accumulator is meant to be dropped afterwards (the lists are handed over)."""
        outs = [
            SampleDelta(
                index=s.index,
                text=s.text(),
                token_ids=s.token_ids,
                logprobs=s.logprobs,
                cumulative_logprob=s.cumulative_logprob,
                finish_reason=s.finish,
                stop_reason=s.stop,
            )
            for s in self._sorted()
        ]
        return RequestDelta(
            request_id=self.request_id,
            outputs=outs,
            finished=self.finished,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            metrics=self.metrics,
            error=self.error,
            error_is_request=self.error_is_request,
            error_type=self.error_type,
        )

    def _sorted(self) -> list[_SampleSum]:
        return [self._samples[i] for i in sorted(self._samples)]
