"""One definition of a request's TPOT, TTFT and speculation counters for every engine in
bench/spec_copy.py. Standard library only: the vLLM peer imports it from the vLLM venv.

TPOT is decode time over tokens: (time of the last token - time of the first) / (tokens - 1),
from the request's own timestamps. Each engine spells them its own way:

- ours: `RequestOutput.metrics.first_token_time` / `last_token_time` / `arrival_time`;
- vLLM V1: `RequestOutput.metrics` is a `RequestStateStats` with `first_token_ts` /
  `last_token_ts` (engine-core monotonic clock) and `first_token_latency` (the TTFT), filled
  only when the `LLM` was made with `disable_log_stats=False`;

and where neither is there, the vLLM peer steps the engine itself and notes when the token
count grows (`tpot_from_observations`): the same quantity, measured at the frontend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def decode_tpot_s(first_token_t: float, last_token_t: float, tokens: int) -> float | None:
    """Seconds per output token after the first; None with under two tokens (no decode)."""
    if tokens < 2:
        return None
    return (last_token_t - first_token_t) / (tokens - 1)


def request_timing(metrics: Any, tokens: int) -> dict[str, Any] | None:
    """{'tpot_s', 'ttft_s', 'source'} from an engine's request metrics object, or None when
    it carries no first/last token times (the caller then measures them itself)."""
    if metrics is None:
        return None
    for first_k, last_k, source in (
        ("first_token_time", "last_token_time", "request_metrics"),
        ("first_token_ts", "last_token_ts", "request_state_stats"),
    ):
        first, last = getattr(metrics, first_k, None), getattr(metrics, last_k, None)
        if not first or not last:  # vLLM leaves 0.0 where stats were not logged
            continue
        ttft = getattr(metrics, "first_token_latency", None)
        if not ttft:
            arrival = getattr(metrics, "arrival_time", None)
            # ours: one monotonic clock; vLLM's arrival is wall time, so only the latency
            ttft = first - arrival if arrival and source == "request_metrics" else None
        return {"tpot_s": decode_tpot_s(first, last, tokens), "ttft_s": ttft, "source": source}
    return None


def tpot_from_observations(obs: Sequence[tuple[float, int]], t_start: float) -> dict[str, Any]:
    """TPOT and TTFT from (time, tokens so far) seen after each engine step, in order.

    The first token's time is that of the first observation with a token; the last token's,
    that of the first observation reaching the final count. Tokens that arrive together (an
    accepted run of proposals) share one time, as they do in the engine's own stamps."""
    with_tokens = [(t, n) for t, n in obs if n > 0]
    if not with_tokens:
        return {"tpot_s": None, "ttft_s": None, "tokens": 0, "source": "step_loop"}
    t_first = with_tokens[0][0]
    final = with_tokens[-1][1]
    t_last = next(t for t, n in with_tokens if n == final)
    return {
        "tpot_s": decode_tpot_s(t_first, t_last, final),
        "ttft_s": t_first - t_start,
        "tokens": final,
        "source": "step_loop",
    }


def first_divergence(a: Sequence[int] | None, b: Sequence[int] | None) -> int | None:
    """The first position where two token sequences differ (the shorter's length if one is
    a prefix of the other); None when they are equal or either is missing."""
    if a is None or b is None:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos_tokens",
}


def spec_counters(metrics: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """vLLM's speculation counters from (name, value) pairs (`LLM.get_metrics()`: a counter's
    value is a number, the per-position one's a list); absent names count 0."""
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                           "accepted_per_pos_tokens": []}  # fmt: skip
    for name, value in metrics:
        key = SPEC_METRICS.get(name)
        if key == "accepted_per_pos_tokens":
            out[key] = [int(v) for v in value]
        elif key is not None:
            out[key] += int(value)
    return out


def spec_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The counters between two `spec_counters` snapshots, in spec_copy.py's record shape."""
    drafts = after["drafts"] - before["drafts"]
    proposed = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    b_pos = before["accepted_per_pos_tokens"]
    per_pos = [
        a - (b_pos[i] if i < len(b_pos) else 0)
        for i, a in enumerate(after["accepted_per_pos_tokens"])
    ]
    return {
        "drafts": drafts,
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "accepted_per_pos": [round(x / drafts, 3) for x in per_pos] if drafts else [],
    }
