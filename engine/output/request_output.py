"""What the engine returns to its callers (offline API and frontends)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.step_io import TokenLogprobs


@dataclass
class CompletionOutput:
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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    # Set when the request failed inside the engine (finish_reason "error").
    error: str | None = None
