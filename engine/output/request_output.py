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


@dataclass(frozen=True)
class SampleError:
    """Why one sample ended with `finish_reason: "error"`: its own constraints (the
    structured-outputs grammar, allowed_token_ids, min_tokens) could not be followed, e.g.
    the grammar engine hit a limit or the masks left no token. `param` names the request
    field at fault (the engine's name, `structured_outputs.<kind>`); the request's other
    samples are not affected. A failure of the engine itself fails the whole request
    (`RequestOutput.error`) instead."""

    message: str
    param: str | None = None


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
    error: SampleError | None = None  # set with finish_reason "error": why this sample ended


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
    # Speculative decoding, over the request's samples: proposal runs verified, proposed
    # and accepted tokens (all 0 without it). Mean acceptance length: 1 + accepted / drafts.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Of num_cached_tokens, those loaded from each KV tier ("host", "disk"), and when the
    # loads were issued and done (the request waited in the loading state meanwhile).
    tier_cached_tokens: dict[str, int] = field(default_factory=dict)
    kv_load_start_time: float | None = None
    kv_load_end_time: float | None = None
    # When the scheduler ended it because its deadline had passed (None: it did not).
    expired_time: float | None = None
    # Queueing and time to first token counted in engine steps (`RequestTimes`): steps
    # begun from its arrival (the one in flight then counted) to the step that first
    # scheduled it / produced its first token.
    queue_steps: int | None = None
    ttft_steps: int | None = None

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        if not self.spec_num_drafts:
            return None
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts


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
    # Set when the request as a whole failed inside the engine (a failed step: every
    # sample "error"); one sample's own failure is its `CompletionOutput.error`.
    error: str | None = None
    # A prefill-only (embedding) request's vector, once it finished.
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    """One input's embedding (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per input, shaped like vLLM's (`out.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def of(cls, out: RequestOutput) -> EmbeddingRequestOutput:
        if out.embedding is None:
            raise ValueError(f"request {out.request_id!r} has no embedding ({out.error})")
        return cls(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.embedding))


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
    error: SampleError | None = None  # with finish_reason "error": this sample's own failure


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
    error: str | None = None  # the request as a whole failed inside the engine (a failed step)
    embedding: list[float] | None = None  # a prefill-only request's vector, on its last delta
    # The exception its stream raises (an engine.errors class: DeadlineExceededError,
    # QueueFullError); None: RequestFailedError.
    error_type: type[Exception] | None = None


class _SampleSum:
    __slots__ = (
        "index", "texts", "token_ids", "logprobs", "cumulative_logprob", "finish", "stop", "error",
    )  # fmt: skip

    def __init__(self, index: int):
        self.index = index
        self.texts: list[str] = []  # joined once, when read: appending stays linear
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.cumulative_logprob: float | None = None
        self.finish: str | None = None
        self.stop: int | str | None = None
        self.error: SampleError | None = None

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
            self.finish, self.stop, self.error = d.finish_reason, d.stop_reason, d.error

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
        self.embedding: list[float] | None = None
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
            self.error, self.error_type = delta.error, delta.error_type
        if delta.embedding is not None:
            self.embedding = delta.embedding
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
                error=s.error,
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
            embedding=self.embedding,
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
                error=s.error,
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
            embedding=self.embedding,
            error_type=self.error_type,
        )

    def _sorted(self) -> list[_SampleSum]:
        return [self._samples[i] for i in sorted(self._samples)]
