"""Which waiting requests can no longer finish before their deadline (the `deadline` policy).

Earliest-deadline-first alone spends the box on the tightest deadlines first, and under
overload those are exactly the requests that expire anyway, part way through their decode:
their compute is lost and the looser requests behind them miss too. So the `deadline`
policy (with `scheduler.defer_late_requests`, on by default) admits a waiting request
whose deadline its remaining work cannot meet only when no request that can still make
its own waits; a deferred request keeps its place, runs when there is room, and otherwise
expires in the queue with nothing computed.

The estimate is the request's remaining steps at the engine's recent step time: its
prompt still to prefill in chunks of the step's token budget, plus the output tokens left
to its explicit `max_tokens` (a request that sets none is never judged late: its length is
unknown). It assumes one token per decode step, so speculative decoding only makes it
pessimistic, and a request that ends early on EOS or a stop string was judged by its upper
bound: both only defer a request, never drop one, and a deferred request still runs when
seats are free. The step time is an exponential average of the intervals between steps
that ran back to back (requests were running when the later one started), on the
scheduler's own clock, so it is exact under a fake clock in tests.
"""

from __future__ import annotations

from engine.core.request import Request

_ALPHA = 0.2  # weight of the newest interval in the step-time average


class StepTimer:
    """The engine's recent step time, from the scheduler's clock at each `schedule()`."""

    def __init__(self) -> None:
        self._last: float | None = None
        self.step_s: float | None = None  # None until a busy interval was seen

    def step_started(self, now: float, busy: bool) -> None:
        """A step starts at `now`; `busy`: requests are running, so the previous step
        scheduled them and this interval was that step's work (an interval that ends with
        nothing running may hold idle waiting and is not counted)."""
        last, self._last = self._last, now
        if busy and last is not None and now >= last:
            dt = now - last
            self.step_s = dt if self.step_s is None else self.step_s + _ALPHA * (dt - self.step_s)


def steps_left(request: Request, chunk_tokens: int) -> int | None:
    """Steps `request` needs to finish from its state now (None: unknown, no explicit
    `max_tokens`)."""
    cap = request.sampling_params.max_tokens
    if cap is None:
        return None
    cap = min(cap, request.max_tokens) if request.max_tokens is not None else cap
    prompt_left = max(0, request.num_prompt_tokens - request.num_computed_tokens)
    prefill_steps = -(-prompt_left // max(1, chunk_tokens))
    # The last prefill chunk samples the first output token.
    decode_steps = max(0, cap - request.num_output_tokens - (1 if prefill_steps else 0))
    return prefill_steps + decode_steps


def is_late(request: Request, now: float, step_s: float | None, chunk_tokens: int) -> bool:
    """True when `request`'s deadline falls before its remaining steps at `step_s` could end."""
    if request.deadline is None or step_s is None:
        return False
    n = steps_left(request, chunk_tokens)
    return n is not None and now + n * step_s > request.deadline
