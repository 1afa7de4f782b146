"""`Tenant.tokens_per_minute`: a token bucket per tenant, reserved at admission and
reconciled when the request finishes.

Each tenant with a rate has a bucket holding at most `tokens_per_minute` tokens, refilled
continuously at `tokens_per_minute / 60` per second (so a burst of one minute's tokens is
allowed after a quiet minute). Admission reserves the request's worst case, prompt +
`max_tokens` (the effective one: the context left when the request did not set it), and
refuses with `TokenRateLimitError` (429, `Retry-After` the seconds until the bucket holds
enough) when the bucket holds less. When the request finishes, however it ends, what it
did not use is given back: it used its prompt and its output tokens if it was ever
scheduled, nothing if it never was. `n > 1` samples each reserve prompt + max_tokens.
A request whose reservation exceeds the whole bucket could never be admitted: it is
refused at once with `InvalidRequestError` naming `max_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.request import Request
from engine.errors import InvalidRequestError, TokenRateLimitError


@dataclass(slots=True)
class _Bucket:
    level: float
    at: float  # when `level` was last brought up to date


class TokenRateLimiter:
    def __init__(self) -> None:
        self._buckets: dict[str, _Bucket] = {}

    @staticmethod
    def reservation(request: Request) -> int:
        return request.num_prompt_tokens + (request.max_tokens or 0)

    def _bucket(self, name: str, tpm: int, now: float) -> _Bucket:
        b = self._buckets.get(name)
        if b is None:
            b = self._buckets[name] = _Bucket(float(tpm), now)
        elif now > b.at:
            b.level = min(float(tpm), b.level + (now - b.at) * tpm / 60.0)
            b.at = now
        return b

    def check(self, request: Request, now: float) -> None:
        """Raises unless `request`'s reservation fits its tenant's bucket now."""
        tenant = request.tenant
        tpm = tenant.tokens_per_minute
        if tpm is None:
            return
        cost = self.reservation(request)
        if cost > tpm:
            raise InvalidRequestError(
                f"the prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
                f"({request.max_tokens}) is {cost} tokens, more than tenant {tenant.name!r} "
                f"may use in a minute ({tpm}); lower max_tokens",
                "max_tokens",
            )
        b = self._bucket(tenant.name, tpm, now)
        if b.level < cost:
            wait = (cost - b.level) * 60.0 / tpm
            raise TokenRateLimitError(
                f"tenant {tenant.name!r} is over its tokens_per_minute ({tpm}): this request "
                f"reserves {cost} tokens (prompt + max_tokens); retry in {wait:.1f}s",
                retry_after_s=wait,
            )

    def reserve(self, request: Request, now: float) -> None:
        """Takes the reservation `check` allowed (call right after it)."""
        tpm = request.tenant.tokens_per_minute
        if tpm is None:
            return
        cost = self.reservation(request)
        self._bucket(request.tenant.name, tpm, now).level -= cost
        request.reserved_tokens = cost

    def settle(self, request: Request, now: float) -> None:
        """Gives back what the finished `request` reserved and did not use."""
        reserved = request.reserved_tokens
        if not reserved:
            return
        request.reserved_tokens = 0
        tpm = request.tenant.tokens_per_minute or 0
        used = 0
        if request.times.first_scheduled is not None:
            used = request.num_prompt_tokens + request.num_output_tokens
        if used < reserved and tpm:
            b = self._bucket(request.tenant.name, tpm, now)
            b.level = min(float(tpm), b.level + reserved - used)
