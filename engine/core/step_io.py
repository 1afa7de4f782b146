"""The two dataclasses that cross between scheduler and runner, and nothing else.

Data flows one way: the scheduler builds a `SchedulerOutput`, the runner executes it and
answers with a `RunnerOutput` of plain lists. The runner never imports the scheduler.

Token ranges for one request in one step::

    all tokens:  [ computed (in KV cache) | scheduled this step | not yet scheduled ]
                 0                num_computed_tokens     + num_scheduled_tokens

A request samples a token this step iff computed + scheduled == its number of known tokens
(prompt + output); a prefill chunk that stops short samples nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (new, resumed after preemption, or a forked sample)."""

    request_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; the runner recomputes their K/V too.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # The full block table.
    block_ids: list[int]
    # Tokens whose K/V are already in the cache (prefix hit or forked blocks).
    num_computed_tokens: int
    # The request's compiled structured-outputs grammar, passed through untouched (the
    # runner builds its matcher from it and replays output_token_ids), or None.
    grammar: object | None = None
    # The request's LoRA adapter weights, passed through untouched (the runner's type), or
    # None for the base model.
    lora: object | None = None
    # Set for a prefill-only (embedding) request: it samples nothing, and the runner
    # answers with its pooled vector once its whole prompt is computed.
    pooling_params: PoolingParams | None = None


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed since its last step."""

    request_id: str
    # Blocks appended to its table this step.
    new_block_ids: list[int]
    # Blocks replaced in place by copy-on-write: (index in table, new block id).
    replaced_block_ids: list[tuple[int, int]]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # request_id -> tokens to run this step (prefill chunk length, or 1 for a decode).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests that left the batch since the last step (finished, aborted or preempted):
    # the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Copy-on-write: copy KV block src into dst, for every layer, before the forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class TokenLogprobs:
    """Logprob of a chosen token plus the top-k alternatives at that position."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the chosen token in the distribution
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass
class PromptLogprobsChunk:
    """Logprobs of consecutive prompt tokens computed in one step for one request.

    `first` is the index of the first entry in the request's list of prompt-token logprobs
    (entry i scores prompt token i + 1). A prompt computed again (after a preemption, or by
    a second sample of the same prompt) yields chunks covering entries already received:
    they replace them, so the list keeps one entry per prompt token."""

    first: int
    logprobs: list[TokenLogprobs]


@dataclass
class RunnerOutput:
    # Requests that sampled this step, in batch order.
    req_ids: list[str] = field(default_factory=list)
    # One list per sampled request (one token today; a list leaves room for speculation).
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Parallel to req_ids when any request asked for logprobs, else None.
    logprobs: list[TokenLogprobs | None] | None = None
    # request_id -> logprobs of prompt tokens 1..P-1 computed this step.
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # request_id -> why it could not sample (its masks left no token): not in req_ids; the
    # engine ends it with this error.
    failed: dict[str, str] = field(default_factory=dict)
    # request_id -> its embedding, for each prefill-only request whose prompt was completed
    # this step (pooled, truncated to its `dimensions`, normalized as asked). Plain floats:
    # nothing but lists crosses back (1,024 floats cost ~10 us to convert).
    pooled: dict[str, list[float]] = field(default_factory=dict)
