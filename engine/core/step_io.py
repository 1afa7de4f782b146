"""The two dataclasses that cross between scheduler and runner, and nothing else.

Data flows one way: the scheduler builds a `SchedulerOutput`, the runner executes it and
answers with a `RunnerOutput` of plain lists. The runner never imports the scheduler.

Token ranges for one request in one step::

    all tokens:  [ computed (in KV cache) | scheduled this step | not yet scheduled ]
                 0                num_computed_tokens     + num_scheduled_tokens

A request samples a token this step iff computed + scheduled == its number of known tokens
(prompt + output); a prefill chunk that stops short samples nothing.

Speculative decoding (docs/speculative.md): a decoding request with k proposed tokens is
scheduled 1 + k tokens, its last known token and the proposals, which are not known tokens::

    tokens:  [ computed | last | d0 d1 .. dk-1 ]        scheduled = 1 + k
    verify:             -> t0    t1 ..  tk              t_j samples the position after it

The runner accepts d_j while t_j == d_j (greedy; the seeded per-position sample for the
id-only proposers; the rejection rule for a draft model) and answers t0..ta: the accepted
proposals and the token after them, a + 1 tokens. The scheduler then takes back the
computed count of the k - a rejected positions and the blocks only they used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

# A KV tier's name in moves and reports (engine/core/kv_tier): pinned host memory, or files.
HOST_TIER = "host"
DISK_TIER = "disk"


@dataclass(frozen=True, slots=True)
class KVMove:
    """One block moved between the KV pool and a tier (engine/core/kv_tier decides them).

    A save copies pool block `block_id` out under `block_hash` (the prefix-cache hash, extra
    keys and all): into host slot `host_slot` when it is >= 0, and to a disk file when
    `to_disk`. A load fills pool block `block_id` with `block_hash`'s KV: from host slot
    `host_slot` when it is >= 0, else from its disk file.
    """

    block_hash: bytes
    block_id: int
    host_slot: int = -1
    to_disk: bool = False


@dataclass
class KVTierReport:
    """What the worker finished of the tier moves since its last report (none are blocking)."""

    # Saves whose copy out of the pool is done: those blocks may be reused.
    copied: list[int] = field(default_factory=list)
    # (block hash, tier) now readable from that tier; and those that could not be stored.
    stored: list[tuple[bytes, str]] = field(default_factory=list)
    store_failed: list[tuple[bytes, str]] = field(default_factory=list)
    # Loads: pool block ids filled; and (block id, why) for those that were not (missing,
    # corrupt, unreadable file): their requests compute those tokens instead.
    loaded: list[int] = field(default_factory=list)
    load_failed: list[tuple[int, str]] = field(default_factory=list)
    # Disk files another process added or removed since the last scan (shared directory):
    # (block hash, bytes, mtime) and block hashes.
    scan_added: list[tuple[bytes, int, float]] = field(default_factory=list)
    scan_removed: list[bytes] = field(default_factory=list)
    # Set once when the disk tier failed for good (ENOSPC, EIO): it is off from then on.
    disk_error: str | None = None
    # Tensor parallelism: block files some ranks hold and others do not (a store that failed
    # on one rank, a save cut short before a restart); the core deletes them everywhere
    # unless its index holds that block meanwhile.
    orphaned: list[bytes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.copied or self.stored or self.store_failed or self.loaded
            or self.load_failed or self.scan_added or self.scan_removed or self.disk_error
            or self.orphaned
        )  # fmt: skip


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
    # Speculative decoding: blocks of the table the runner holds that are kept, before
    # new_block_ids are appended (the scheduler gave back the blocks only rejected tokens
    # used). None: all of them.
    num_blocks_kept: int | None = None


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
    # Speculative decoding: request_id -> the proposed tokens scheduled after its last
    # known token (num_scheduled_tokens counts them).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> tokens a worker-side proposer (a draft model) proposes for the request's
    # next step after this one; the slots its KV needs past this step's are allocated.
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)
    # KV tier moves, carried out off the engine thread (results come back in a later
    # RunnerOutput's `kv_tier`): saves of blocks held out of the free queue until copied,
    # loads into blocks no request reads until loaded, and disk files to delete (evicted).
    kv_saves: list[KVMove] = field(default_factory=list)
    kv_loads: list[KVMove] = field(default_factory=list)
    kv_deletes: list[bytes] = field(default_factory=list)

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
    # One list per sampled request: its accepted tokens (one without speculation; the
    # accepted proposals and the token after them with it).
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Parallel to sampled_token_ids when any request asked for logprobs, else None: one
    # entry per sampled token, or None for a request that did not ask.
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # request_id -> logprobs of prompt tokens 1..P-1 computed this step.
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # request_id -> why it could not sample (its masks left no token): not in req_ids; the
    # engine ends it with this error.
    failed: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: request_id -> tokens a worker-side proposer (a draft model, the
    # grammar's forced tokens) proposes for the request's next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The KV tier moves finished since the last step (None: no tier, or nothing finished).
    kv_tier: KVTierReport | None = None
    # request_id -> its embedding, for each prefill-only request whose prompt was completed
    # this step (pooled, truncated to its `dimensions`, normalized as asked). Plain floats:
    # nothing but lists crosses back (1,024 floats cost ~10 us to convert).
    pooled: dict[str, list[float]] = field(default_factory=dict)
