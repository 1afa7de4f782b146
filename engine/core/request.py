"""One generation request as the scheduler and KV cache manager see it.

A request has no prefill or decode phase: it has `num_computed_tokens` (tokens whose K/V
sit in the cache) and `num_tokens` (prompt + output so far). Each step the scheduler hands
it some of the difference. `n > 1` requests are split by the engine into one `Request` per
sample; samples after the first carry `fork_from`, the id of the first, so the scheduler can
share its prompt blocks instead of prefilling the prompt again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.policy.tenant import DEFAULT_TENANT, Tenant
from engine.lora_request import LoRARequest
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core.spec.state import SpecState


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue after losing its blocks
    FINISHED_STOPPED = 3  # EOS, stop token id or stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestTimes:
    """Engine-side timestamps (time.monotonic()), the source of metrics and trace spans."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    preempted: list[float] = field(default_factory=list)
    # KV tier: when its loads were issued and when the last one was reported (the loading
    # state; its time counts in TTFT like any wait).
    kv_load_started: float | None = None
    kv_load_finished: float | None = None
    # When the scheduler ended it because its deadline had passed (None: it did not).
    expired: float | None = None
    # The same moments counted in engine steps (`Scheduler.num_steps_started` then): steps
    # begun before it was queued (the one in flight counted), and the steps that first
    # scheduled it and produced its first token. Queueing in steps is first_scheduled_step
    # - queued_step: 1 when the first step after its arrival takes it.
    queued_step: int | None = None
    first_scheduled_step: int | None = None
    first_token_step: int | None = None


class Request:
    """Mutable per-request state owned by the scheduler."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | tuple[str, ...] | None = None,
        fork_from: str | None = None,
        max_tokens: int | None = None,
        grammar: object | None = None,
        lora_request: LoRARequest | None = None,
        lora_key: bytes | None = None,
        lora: object | None = None,
        pooling_params: PoolingParams | None = None,
        tenant: Tenant | None = None,
        deadline: float | None = None,
    ):
        """`pooling_params`: a prefill-only (embedding) request; its `sampling_params` are
        then a default nothing reads, and it finishes when its prompt is computed."""
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # The model's EOS ids (tokenizer's and generation config's): any of them ends the
        # request with stop_reason None unless `ignore_eos`.
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        # Extra keys of its blocks' hashes: requests with different salts never share cached
        # blocks. A tuple when the server salts by API key too: (the key's, the user's).
        self.cache_salt: tuple[str, ...] = (
            (cache_salt,) if isinstance(cache_salt, str) else tuple(cache_salt or ())
        )
        # The adapter it runs (None: the base model): its name for metrics and removals, its
        # content key for the prefix cache, and its weights (opaque here: the runner's type).
        self.lora_request = lora_request
        self.lora_key = lora_key
        self.lora = lora
        # Everything a block's hash depends on besides tokens, in one tuple: the salts, then
        # the adapter (so two adapters never share cached KV, and a salt never collides
        # with an adapter key: bytes and strings encode differently).
        self.cache_keys: tuple[str | bytes, ...] = self.cache_salt + (
            (lora_key,) if lora_key is not None else ()
        )
        self.fork_from = fork_from
        # The compiled structured-outputs grammar (opaque here: the runner's type), or None.
        self.grammar = grammar
        self.pooling_params = pooling_params
        # Effective output cap: sampling_params.max_tokens clipped to the context left.
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first scheduling (for metrics/traces).
        self.num_cached_tokens = 0
        # Of those, tokens loaded from each KV tier ("host", "disk"); empty without a tier.
        self.tier_cached_tokens: dict[str, int] = {}
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Speculative decoding's per-request state (engine.core.spec), made on first use.
        self.spec: SpecState | None = None
        self.times = RequestTimes()
        if arrival_time is not None:
            self.times.arrival = arrival_time
        # Scheduling policy (engine/core/policy): whose share it runs on, the time on the
        # scheduler's clock by which it must have finished (None: no deadline), the highest
        # token position charged to its tenant (positions below it are recompute), and the
        # tokens reserved against its tenant's tokens_per_minute.
        self.tenant = tenant if tenant is not None else DEFAULT_TENANT
        self.deadline = deadline
        self.num_charged_tokens = 0
        self.reserved_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def prefill_only(self) -> bool:
        """An embedding request: its prompt runs through the model once, nothing is
        sampled, and it finishes (its blocks freed) when the runner returns its vector."""
        return self.pooling_params is not None

    @property
    def skips_prefix_cache_reads(self) -> bool:
        """True when every prompt token must go through the model: prompt logprobs come
        out of the forward pass, and a prompt block served from the prefix cache is never
        computed. Its blocks are still cached for others (their K/V are the same), unless
        it is prefill-only (see `writes_prefix_cache`). Pooling reads every prompt token's
        hidden state, so a prefill-only request skips the reads too."""
        return self.sampling_params.prompt_logprobs is not None or self.pooling_params is not None

    @property
    def writes_prefix_cache(self) -> bool:
        """False for a prefill-only request: its KV is dropped when it finishes, so its
        blocks are never registered in the prefix cache (nor offered to any KV tier)."""
        return self.pooling_params is None

    @property
    def uses_kv_tier(self) -> bool:
        """True when a KV tier may serve its prefix (engine/core/kv_tier): like a prefix-cache
        read. A request that skips prefix reads (prompt logprobs, prefill-only embedding
        requests) never reaches a tier; one that registers no blocks never saves any."""
        return not self.skips_prefix_cache_reads

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drops output tokens past the first `num_output_tokens` (a stop string inside a
        run of several tokens accepted in one step ends the output there)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - drop :]
            self.num_computed_tokens = min(self.num_computed_tokens, len(self.all_token_ids))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
