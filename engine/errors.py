"""Errors the engine raises to its callers; the frontends map them to protocol errors."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base class for engine failures."""


class InvalidRequestError(ValueError):
    """A request the engine can never serve as given; `param` names the offending field.

    Every request error takes `(message, param)`. Frontends answer it with HTTP 400 / gRPC
    INVALID_ARGUMENT.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt plus output cannot fit the model's context (OpenAI `context_length_exceeded`)."""


class UnsatisfiableRequestError(InvalidRequestError):
    """The request's own constraints (grammar, allowed_token_ids, min_tokens, logit_bias)
    left no token to sample at some step. Found only while generating, so it fails that one
    request like a step failure does, but it is the request's fault: HTTP 400 / gRPC
    INVALID_ARGUMENT, not a server error."""


class LoRAError(InvalidRequestError):
    """An adapter that cannot be used as asked: unreadable or unsupported PEFT files, a rank
    above `lora.max_lora_rank`, shapes that do not fit the base model, LoRA off, a name
    taken by another path, or an adapter being removed. The message names the problem;
    frontends answer HTTP 400 / gRPC INVALID_ARGUMENT."""

    def __init__(self, message: str, param: str | None = "lora_request"):
        super().__init__(message, param)


class LoRANotFoundError(LoRAError):
    """No adapter of that name is loaded (`remove_lora` of an unknown name): HTTP 404."""


class LoRAPathError(LoRAError):
    """An adapter file whose real path lies outside the directories the adapter may be read
    from (`LoRARequest.allowed_dirs`, the appliance's `lora.allowed_dirs`): HTTP 403. The
    message never says where the file points or whether its target exists."""


class QueueFullError(EngineError):
    """The waiting queue is at `scheduler.max_queue_len` (HTTP 429 / RESOURCE_EXHAUSTED).

    `retry_after_s`: when a retry may succeed (HTTP `Retry-After`); `code`: the error code
    the frontends report (each subclass names its own limit)."""

    code = "queue_full"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TenantQueueFullError(QueueFullError):
    """The request's tenant already has `max_queued` requests waiting (HTTP 429 for that
    tenant only; the others are still admitted)."""

    code = "tenant_queue_full"


class TokenRateLimitError(QueueFullError):
    """The request's tenant is over its `tokens_per_minute`: `retry_after_s` is when its
    bucket holds the request's reservation again (HTTP 429 with `Retry-After`)."""

    code = "tokens_per_minute_exceeded"


class DeadlineExceededError(EngineError):
    """The request's deadline passed before it finished: dropped from the queue before any
    compute, or aborted at the next step if it was running (HTTP 504 / gRPC
    DEADLINE_EXCEEDED)."""


class EngineDeadError(EngineError):
    """The engine loop has stopped after an unrecoverable failure (HTTP 503 / UNAVAILABLE)."""


class RequestFailedError(EngineError):
    """A step raised while this request was in it; the request was failed, the engine lives."""


class WorkerFailedError(EngineDeadError):
    """A tensor-parallel worker died or hung, or a failed step left the ranks out of step:
    the engine can run no further step. The message names the rank and what happened."""
