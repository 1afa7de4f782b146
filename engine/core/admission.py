"""Admission: the one place that decides whether a request may be queued.

Every entry point (offline `LLM`, `LLMEngine`, the async engine behind HTTP and gRPC) goes
through these checks, so a limit and its message are written once:

- `fit_lengths`: the request fits the model's context and, at its longest, the whole KV
  pool (so with preemption it can always finish, however busy the pool);
  `fit_prompt` is the same rule for a prefill-only (embedding) request, which outputs
  nothing and so may fill the whole context;
- `check_task`: the request is of the kind the model serves (generation or embeddings);
- `check_new_id`: the id is not held already;
- `check_queue_room`: the waiting queue has room for all of a request's samples (with
  tenants, a full queue pushes out the most over-share tenant's requests first:
  `engine.core.policy.overflow`);
- `check_deadline`: the request's deadline has not passed already;
- `check_tenant_queue_room`: its tenant has fewer than `max_queued` requests waiting;
- `check_stop_limits`: stop strings and stop token ids within the scheduler's bounds.

A tenant's `tokens_per_minute` is checked beside these, by `engine.core.policy.token_rate`.
"""

from __future__ import annotations

from collections.abc import Container

from engine.config import SchedulerConfig
from engine.core.policy.tenant import Tenant
from engine.errors import (
    ContextLengthError,
    DeadlineExceededError,
    InvalidRequestError,
    QueueFullError,
    TenantQueueFullError,
)
from engine.sampling_params import SamplingParams, SamplingParamsError


def fit_lengths(
    prompt_len: int, max_tokens: int | None, max_model_len: int, block_size: int, num_blocks: int
) -> int:
    """The request's effective `max_tokens` (the context left when None), or raises.

    At its longest a request holds `kv_blocks_for(stored_tokens(...))` blocks.
    """
    limit = max_model_len
    if prompt_len >= limit:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{prompt_len} tokens (at least one token must be left to generate)",
            "prompt",
        )
    if max_tokens is None:
        max_tokens = limit - prompt_len
    elif prompt_len + max_tokens > limit:
        raise ContextLengthError(
            f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds this "
            f"model's maximum context length of {limit} tokens",
            "max_tokens",
        )
    if kv_blocks_for(prompt_len, block_size) > num_blocks:
        raise InvalidRequestError(
            f"the prompt's {prompt_len} tokens need {kv_blocks_for(prompt_len, block_size)} KV "
            f"blocks but the whole cache has {num_blocks}",
            "prompt",
        )
    needed = kv_blocks_for(stored_tokens(prompt_len, max_tokens), block_size)
    if needed > num_blocks:
        raise InvalidRequestError(
            f"prompt plus max_tokens needs {needed} KV blocks but the whole cache has "
            f"{num_blocks}; lower max_tokens",
            "max_tokens",
        )
    return max_tokens


def fit_prompt(prompt_len: int, max_model_len: int, block_size: int, num_blocks: int) -> None:
    """Raises unless a prefill-only request of `prompt_len` tokens fits: at most the model's
    context (no token is generated after it) and the whole KV pool (it holds every prompt
    token's K/V until its last chunk is computed)."""
    if prompt_len > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens, but the input has "
            f"{prompt_len} tokens (shorten it, or set truncate_prompt_tokens)",
            "input",
        )
    if kv_blocks_for(prompt_len, block_size) > num_blocks:
        raise InvalidRequestError(
            f"the input's {prompt_len} tokens need {kv_blocks_for(prompt_len, block_size)} KV "
            f"blocks but the whole cache has {num_blocks}",
            "input",
        )


def check_task(model_task: str, request_task: str, model_name: str) -> None:
    """Raises InvalidRequestError (param `model`) unless a `request_task` request (generate
    or embed) can run on a model whose task is `model_task`."""
    if model_task == request_task:
        return
    if model_task == "embed":
        what = "it serves embeddings (/v1/embeddings, gRPC Embed), not generation"
    else:
        what = "it serves generation, not embeddings (start an embedding model: model.task embed)"
    raise InvalidRequestError(f"model {model_name!r} has task {model_task!r}: {what}", "model")


def stored_tokens(prompt_len: int, max_tokens: int) -> int:
    """Tokens whose K/V a request holds at its longest: the prompt's, and every sampled
    token's but the last (it is returned, never fed back)."""
    return max(prompt_len, prompt_len + max_tokens - 1)


def kv_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens' K/V: the KV-fit rule of admission and of the
    start-up check that one `max_model_len` request fits the pool."""
    return -(-num_tokens // block_size)


def max_request_blocks(max_model_len: int, block_size: int) -> int:
    """Blocks the longest request `fit_lengths` admits holds: a prompt of max_model_len - 1
    tokens and one sampled token. A pool smaller than this refuses every request that asks
    for the whole context (a chat request without max_tokens), so start-up refuses it."""
    return kv_blocks_for(stored_tokens(max_model_len - 1, 1), block_size)


def check_new_id(request_id: str, held: Container[str]) -> None:
    """Raises unless `request_id` is free (clients may choose ids, e.g. over gRPC)."""
    if request_id in held:
        raise InvalidRequestError(f"duplicate request id {request_id!r}", "request_id")


def check_queue_room(num_waiting: int, num_new: int, max_queue_len: int) -> None:
    """Raises `QueueFullError` unless `num_new` more requests fit the waiting queue."""
    if num_waiting + num_new > max_queue_len:
        raise QueueFullError(f"the waiting queue is full ({max_queue_len} requests); retry later")


def check_deadline(deadline: float | None, now: float) -> None:
    """Raises `DeadlineExceededError` when `deadline` (scheduler clock) is not after `now`:
    a request that arrives expired is never queued."""
    if deadline is not None and deadline <= now:
        raise DeadlineExceededError(
            f"the request's deadline passed {now - deadline:.3f}s before it reached the queue"
        )


def check_tenant_queue_room(tenant: Tenant, num_queued: int) -> None:
    """Raises `TenantQueueFullError` when `tenant` already has `max_queued` requests
    waiting (its other requests and every other tenant's are unaffected)."""
    limit = tenant.max_queued
    if limit is not None and num_queued >= limit:
        raise TenantQueueFullError(
            f"tenant {tenant.name!r} already has {num_queued} requests waiting "
            f"(max_queued {limit}); retry later"
        )


def check_stop_limits(params: SamplingParams, limits: SchedulerConfig) -> None:
    """Raises SamplingParamsError unless the stop conditions are within `limits`
    (`scheduler.max_stop_*`).

    Checked before anything is built from them: each sample's detokenizer works in time
    and memory linear in the stop strings, and the min_tokens mask in the distinct ids.
    """
    stops, ids = params.stop, params.stop_token_ids
    if len(stops) > limits.max_stop_strings:
        raise SamplingParamsError(
            f"at most {limits.max_stop_strings} stop strings, got {len(stops)}", "stop"
        )
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise SamplingParamsError(
            f"a stop string may have at most {limits.max_stop_string_chars} characters, "
            f"got one of {longest}",
            "stop",
        )
    if len(ids) > limits.max_stop_token_ids:
        raise SamplingParamsError(
            f"at most {limits.max_stop_token_ids} distinct ids, got {len(ids)}", "stop_token_ids"
        )
