"""The appliance's configuration: the engine's sections plus graphs, server and telemetry.

Every section is a frozen dataclass whose defaults are the documented defaults (and what
`config/default.yaml` spells out). The engine's own sections (`model`, `cache`,
`scheduler`) are reused as they are; `graphs` and `runtime` are split here for the YAML's
sake and folded into the engine's single `RuntimeConfig` by `AppConfig.engine_config()`.
Checks raise `ConfigError` naming the key's dotted path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)

OTLP_PROTOCOLS = ("grpc", "http/protobuf")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("logfmt", "json")


def _require(cond: bool, key: str, reason: str) -> None:
    if not cond:
        raise ConfigError(key, reason)


def _valid_port(port: int) -> bool:
    return 0 <= port <= 65535


@dataclass(frozen=True)
class GraphsConfig:
    """torch.compile and CUDA-graph policy (folded into the engine's RuntimeConfig)."""

    cuda_graphs: bool = True
    # Batch sizes to capture; None: 1, 2, 4, 8, 16, ... up to scheduler.max_num_seqs.
    capture_sizes: tuple[int, ...] | None = None
    compile: bool = False
    compile_cache_dir: str | None = None


@dataclass(frozen=True)
class RuntimeSection:
    """Where the model runs (the YAML's `runtime` section)."""

    device: str = "auto"
    num_threads: int | None = None
    cpu_kernels: bool = True
    attention_backend: str = "auto"  # auto | flashinfer | torch (see RuntimeConfig)
    malloc_keep_mib: int = 1024  # see RuntimeConfig


@dataclass(frozen=True)
class LoRASection:
    """LoRA adapters (the YAML's `lora` section; the engine's part folds into LoRAConfig)."""

    enabled: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Adapters loaded at start: served name -> PEFT directory.
    modules: dict[str, str] = field(default_factory=dict)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API keys).
    allow_runtime_updates: bool = False
    # Directories runtime loads may read from; a path outside them is refused (403).
    allowed_dirs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        LoRAConfig(  # the engine's checks, under the same keys
            enabled=self.enabled,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
        )
        _require(
            self.enabled or not (self.modules or self.allow_runtime_updates),
            "lora.enabled",
            "must be true when lora.modules or lora.allow_runtime_updates is set",
        )
        _require(all(self.modules), "lora.modules", "adapter names must be non-empty")
        _require(all(self.allowed_dirs), "lora.allowed_dirs", "entries must be non-empty")
        _require(
            bool(self.allowed_dirs) or not self.allow_runtime_updates,
            "lora.allowed_dirs",
            "must list at least one directory when lora.allow_runtime_updates is true "
            "(runtime loads read only from under them)",
        )

    def engine_config(self) -> LoRAConfig:
        return LoRAConfig(
            enabled=self.enabled,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
        )


@dataclass(frozen=True)
class TenantConfig:
    """One tenant of `server.tenants` (the mapping's key is its name): the API keys that
    belong to it, its weight (its share of the engine relative to the other tenants' under
    the fair policies) and optional limits. See docs/tenancy.md."""

    keys: tuple[str, ...] = ()
    weight: float = 1.0
    # Requests of this tenant in the running batch at once; null: no limit.
    max_running: int | None = None
    # Requests of this tenant waiting at once; more get 429 (that tenant only).
    max_queued: int | None = None
    # Tokens (prompt + max_tokens reserved at admission, reconciled at finish) per minute;
    # over it: 429 with Retry-After.
    tokens_per_minute: int | None = None

    def check(self, name: str) -> None:
        """Raises ConfigError naming `server.tenants.<name>.<key>`."""
        key = f"server.tenants.{name}"
        _require(bool(name.strip()), "server.tenants", "tenant names must be non-empty")
        _require(
            math.isfinite(self.weight) and self.weight > 0,
            f"{key}.weight",
            f"must be a finite number > 0, got {self.weight!r}",
        )
        for limit in ("max_running", "max_queued", "tokens_per_minute"):
            v = getattr(self, limit)
            _require(v is None or v >= 1, f"{key}.{limit}", "must be >= 1 or null")
        _require(all(self.keys), f"{key}.keys", "keys must be non-empty strings")
        _require(
            bool(self.keys) or name == "default",
            f"{key}.keys",
            "must list at least one API key (only the `default` tenant, which every key "
            "under no tenant belongs to, may have none)",
        )


@dataclass(frozen=True)
class ServerConfig:
    """HTTP (and gRPC) frontends."""

    host: str = "127.0.0.1"
    # 0 picks a free port (logged at start).
    http_port: int = 8000
    # None disables the gRPC frontend.
    grpc_port: int | None = 50051
    # Empty: no authentication. Otherwise `Authorization: Bearer <key>` on /v1/*, /tokenize
    # and /detokenize.
    api_keys: tuple[str, ...] = ()
    # Bytes; larger request bodies get 413 (HTTP) or RESOURCE_EXHAUSTED (gRPC messages).
    max_request_body: int = 8 * 1024 * 1024
    # Bytes of request line plus headers; larger get 431. Bounds what a client can make the
    # server buffer before any route (or the API-key check) runs.
    max_header_bytes: int = 16 * 1024
    # Seconds a connection may take to send a request's line and headers (from when it
    # opens, or from the first byte of the next request on a kept-alive one); then it is
    # closed. Bounds idle and half-sent connections (uvicorn has no such timeout).
    header_timeout_s: float = 20.0
    # Seconds a request's body may take to arrive once the route reads it; then 408 and the
    # connection is closed.
    body_timeout_s: float = 60.0
    # Empty: CORS off. ["*"] allows any origin.
    cors_origins: tuple[str, ...] = ()
    # Seconds in-flight requests may take to finish after SIGTERM.
    shutdown_grace_s: float = 30.0
    # Prompts and outputs appear in logs only when true.
    log_prompts: bool = False
    # Seconds one engine step may run before the engine counts as hung: health turns
    # unhealthy and `appliance serve` exits non-zero. None: no watchdog.
    step_timeout_s: float | None = 300.0
    # Prompts, chat messages, texts to tokenize and ids to detokenize longer than this
    # (characters, or token ids) are handled in a worker thread, so one huge input cannot
    # stall every other stream on the event loop. One threshold for HTTP, gRPC and the
    # engine's admission.
    offload_prompt_chars: int = 8192
    # gRPC calls held before a handler takes them; past it gRPC core cancels new calls
    # (CANCELLED) instead of the queue refusing them (RESOURCE_EXHAUSTED).
    grpc_max_pending_calls: int = 16384
    # Salt every request's prefix-cache entries by its API key (a hash of it), so tenants
    # never share cached blocks (nor learn each other's prompts from cached_tokens).
    cache_salt_by_api_key: bool = False
    # How chat answers are read for tool calls (vLLM's --tool-call-parser): auto (from the
    # chat template; hermes when it has no tools section), hermes, llama3, mistral, or none
    # (tools are refused with a 400).
    tool_parser: str = "auto"
    # How a reasoning section is split into `reasoning_content` (vLLM's --reasoning-parser):
    # none, qwen3 (`<think>` at the start of the answer) or deepseek_r1 (reasoning until
    # `</think>`, its opening tag being in the prompt).
    reasoning_parser: str = "none"
    # Tenants: name -> TenantConfig. A request's tenant is the one its API key is listed
    # under (keys under no tenant, and every request when there are no keys, belong to
    # `default`); tenant keys are added to api_keys. Fair share (scheduler.policy auto ->
    # fair) and the limits are per tenant. See docs/tenancy.md.
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    # Salt prefix-cache entries by tenant (a hash of its name): tenants never share cached
    # blocks; a tenant's keys do.
    cache_salt_by_tenant: bool = False
    # Seconds a request may take from arrival to finish when it sets no deadline itself
    # (HTTP X-Request-Timeout, the gRPC deadline, KServe's `timeout`); then it is dropped
    # from the queue (HTTP 504, gRPC DEADLINE_EXCEEDED) or stopped if running. null: none.
    default_request_timeout_s: float | None = None

    def __post_init__(self) -> None:
        self._check_tenants()
        _require(bool(self.host), "server.host", "must not be empty")
        _require(
            self.tool_parser in ("auto", "hermes", "llama3", "mistral", "none"),
            "server.tool_parser",
            "must be one of auto, hermes, llama3, mistral, none",
        )
        _require(
            self.reasoning_parser in ("none", "qwen3", "deepseek_r1"),
            "server.reasoning_parser",
            "must be one of none, qwen3, deepseek_r1",
        )
        _require(_valid_port(self.http_port), "server.http_port", "must be in [0, 65535]")
        if self.grpc_port is not None:
            _require(_valid_port(self.grpc_port), "server.grpc_port", "must be in [0, 65535]")
            _require(
                self.grpc_port == 0 or self.grpc_port != self.http_port,
                "server.grpc_port",
                "must differ from server.http_port",
            )
        _require(all(self.api_keys), "server.api_keys", "keys must be non-empty strings")
        _require(self.max_request_body >= 1024, "server.max_request_body", "must be >= 1024")
        _require(self.max_header_bytes >= 1024, "server.max_header_bytes", "must be >= 1024")
        _require(self.header_timeout_s > 0, "server.header_timeout_s", "must be > 0")
        _require(self.body_timeout_s > 0, "server.body_timeout_s", "must be > 0")
        _require(self.shutdown_grace_s >= 0, "server.shutdown_grace_s", "must be >= 0")
        if self.step_timeout_s is not None:
            _require(self.step_timeout_s > 0, "server.step_timeout_s", "must be > 0 or null")
        _require(self.offload_prompt_chars >= 0, "server.offload_prompt_chars", "must be >= 0")
        _require(self.grpc_max_pending_calls >= 1, "server.grpc_max_pending_calls", "must be >= 1")
        _require(
            not self.cache_salt_by_api_key or bool(self.api_keys),
            "server.cache_salt_by_api_key",
            "needs server.api_keys (there is no key to salt by)",
        )
        _require(
            not self.cache_salt_by_tenant or bool(self.tenants),
            "server.cache_salt_by_tenant",
            "needs server.tenants (every request is the default tenant's)",
        )
        if self.default_request_timeout_s is not None:
            t = self.default_request_timeout_s
            _require(
                math.isfinite(t) and t > 0,
                "server.default_request_timeout_s",
                "must be a finite number of seconds > 0, or null",
            )

    def _check_tenants(self) -> None:
        """Each tenant's settings; a key under two tenants is refused; every tenant key
        joins `api_keys` (built in code, tenants may be given as plain mappings)."""
        tenants: dict[str, TenantConfig] = {}
        owner: dict[str, str] = {}
        for name, t in self.tenants.items():
            if isinstance(t, Mapping):
                try:
                    t = TenantConfig(**t)
                except TypeError as e:
                    raise ConfigError(f"server.tenants.{name}", str(e)) from None
            t.check(name)
            for i, k in enumerate(t.keys):
                _require(
                    owner.get(k, name) == name,
                    f"server.tenants.{name}.keys",
                    f"key #{i + 1} is also listed under tenant {owner.get(k)!r}: a key "
                    "belongs to one tenant",
                )
                owner[k] = name
            tenants[name] = t
        object.__setattr__(self, "tenants", tenants)
        if owner:
            object.__setattr__(self, "api_keys", tuple(dict.fromkeys((*self.api_keys, *owner))))


@dataclass(frozen=True)
class ResponsesSection:
    """The Responses API's store (`/v1/responses` with `store: true`, docs/responses.md)."""

    # SQLite file of stored responses; None: responses.sqlite3 under the appliance's cache
    # directory ($APPLIANCE_CACHE, else ~/.cache/appliance). ":memory:" keeps them in
    # memory only (lost on restart).
    store_path: str | None = None
    # Responses kept at most; past it the oldest are evicted. 0: nothing is stored
    # (`store: true` answers as `store: false`; previous_response_id finds nothing).
    max_stored: int = 10000
    # Seconds a stored response lives; older ones are evicted (and 404). None: no limit.
    ttl_s: float | None = 30 * 24 * 3600.0

    def __post_init__(self) -> None:
        _require(
            self.store_path is None or bool(self.store_path),
            "responses.store_path",
            'must be a path, ":memory:" or null',
        )
        _require(self.max_stored >= 0, "responses.max_stored", "must be >= 0")
        if self.ttl_s is not None:
            _require(self.ttl_s > 0, "responses.ttl_s", "must be > 0 or null")


@dataclass(frozen=True)
class TelemetryConfig:
    """Logs, Prometheus and OpenTelemetry export."""

    # None: tracing off. E.g. http://collector:4317 (grpc) or http://collector:4318 (http).
    otlp_endpoint: str | None = None
    otlp_protocol: str = "grpc"
    otlp_headers: dict[str, str] = field(default_factory=dict)
    service_name: str = "appliance"
    # Fraction of requests traced (parent-based when a traceparent arrives).
    sampling_ratio: float = 1.0
    log_level: str = "info"
    log_format: str = "logfmt"

    def __post_init__(self) -> None:
        _require(
            self.otlp_protocol in OTLP_PROTOCOLS,
            "telemetry.otlp_protocol",
            f"must be one of {OTLP_PROTOCOLS}",
        )
        _require(bool(self.service_name), "telemetry.service_name", "must not be empty")
        _require(0.0 <= self.sampling_ratio <= 1.0, "telemetry.sampling_ratio", "must be in [0, 1]")
        _require(
            self.log_level in LOG_LEVELS, "telemetry.log_level", f"must be one of {LOG_LEVELS}"
        )
        _require(
            self.log_format in LOG_FORMATS, "telemetry.log_format", f"must be one of {LOG_FORMATS}"
        )


# The YAML's sections, in the order they are documented and printed.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "graphs": GraphsConfig,
    "runtime": RuntimeSection,
    "parallel": ParallelConfig,
    "lora": LoRASection,
    "structured_outputs": StructuredOutputsConfig,
    "speculative": SpeculativeConfig,
    "server": ServerConfig,
    "responses": ResponsesSection,
    "telemetry": TelemetryConfig,
}

# Engine RuntimeConfig fields that the YAML spells under `graphs`.
_GRAPHS_FIELDS = tuple(f.name for f in dataclasses.fields(GraphsConfig))


def yaml_key_error(e: ConfigError) -> ConfigError:
    """An engine ConfigError under the key the YAML spells: runtime.<graphs field> is graphs.*.

    The engine names its own RuntimeConfig keys (it raises some only at start, e.g. LoRA
    with CUDA graphs); a user reading the message edits the YAML, where they live under graphs.
    """
    section, _, name = e.key.partition(".")
    if section == "runtime" and name in _GRAPHS_FIELDS:
        reason = e.reason.replace(f"runtime.{name}", f"graphs.{name}")
        return ConfigError(f"graphs.{name}", reason)
    return e


@dataclass(frozen=True)
class AppConfig:
    """Everything one YAML file configures."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    graphs: GraphsConfig = field(default_factory=GraphsConfig)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRASection = field(default_factory=LoRASection)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    responses: ResponsesSection = field(default_factory=ResponsesSection)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def engine_config(self) -> EngineConfig:
        """The engine's view; a RuntimeConfig error on a graphs field is renamed to graphs.*.
        `scheduler.policy: auto` becomes fair with server.tenants, fcfs without."""
        try:
            runtime = RuntimeConfig(
                device=self.runtime.device,
                num_threads=self.runtime.num_threads,
                cpu_kernels=self.runtime.cpu_kernels,
                attention_backend=self.runtime.attention_backend,
                malloc_keep_mib=self.runtime.malloc_keep_mib,
                **{name: getattr(self.graphs, name) for name in _GRAPHS_FIELDS},
            )
        except ConfigError as e:
            renamed = yaml_key_error(e)
            if renamed is not e:
                raise renamed from None
            raise
        scheduler = self.scheduler
        if scheduler.policy == "auto":
            policy = "fair" if self.server.tenants else "fcfs"
            scheduler = dataclasses.replace(scheduler, policy=policy)
        return EngineConfig(
            model=self.model,
            cache=self.cache,
            scheduler=scheduler,
            runtime=runtime,
            parallel=self.parallel,
            lora=self.lora.engine_config(),
            structured_outputs=self.structured_outputs,
            speculative=self.speculative,
        )
