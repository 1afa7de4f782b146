"""Admission checks: refuse at `add_request` a request that no schedule could ever finish."""

from __future__ import annotations

from engine.core.request import Request
from engine.errors import InvalidRequestError


class RequestRejectedError(InvalidRequestError):
    """A request that can never run under this model length or KV pool; `param` names why.

    An `InvalidRequestError` (a `ValueError`), so frontends answer it with a 400.
    """

    def __init__(self, param: str, reason: str):
        super().__init__(f"{param}: {reason}", param)
        self.reason = reason


def check_request_fits(
    request: Request, max_model_len: int, block_size: int, num_blocks: int
) -> None:
    """Raises `RequestRejectedError` unless the request fits the model and the whole pool.

    Sets `request.max_tokens` to the context left when it is None. K/V is stored for every
    token but the last sampled one, so at its longest a request holds
    `ceil((prompt + max_tokens - 1) / block_size)` blocks; with preemption it can always get
    them, however busy the pool.
    """
    limit, prompt_len = max_model_len, request.num_prompt_tokens
    if prompt_len > limit - 1:
        raise RequestRejectedError(
            "prompt",
            f"the prompt has {prompt_len} tokens but the model's context is {limit}, "
            "leaving no room for an output token",
        )
    if request.max_tokens is None:
        request.max_tokens = limit - prompt_len
    if prompt_len + request.max_tokens > limit:
        raise RequestRejectedError(
            "max_tokens",
            f"max_tokens={request.max_tokens} plus the prompt's {prompt_len} tokens "
            f"exceeds the model's context of {limit}",
        )
    if -(-prompt_len // block_size) > num_blocks:
        raise RequestRejectedError(
            "prompt", f"the prompt needs more than the KV cache's {num_blocks} blocks"
        )
    if -(-(prompt_len + request.max_tokens - 1) // block_size) > num_blocks:
        raise RequestRejectedError(
            "max_tokens",
            f"prompt plus max_tokens needs more than the KV cache's {num_blocks} blocks",
        )
