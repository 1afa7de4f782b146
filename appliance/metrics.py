"""Prometheus metrics for one appliance, in its own CollectorRegistry.

Two sources: engine counters and gauges (running, waiting, KV usage, prefix cache,
preemptions, tokens) are read from `AsyncEngine.stats()` at scrape time by a custom
collector, so they are never stale and cost nothing between scrapes; per-request latency
histograms and outcomes are fed by an AsyncEngine finish listener from the engine's own
monotonic timestamps (arrival, first scheduled, first token, last token, finished).
With LoRA on, the per-adapter series come from the same snapshot (running, waiting) and
from the adapter registry (requests admitted per adapter, counted by every frontend).
A per-app registry (not the global one) lets tests and several apps in one process coexist.

With speculative decoding on, its counters are exported under vLLM's names
(`vllm:spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`,
`_num_accepted_tokens_per_pos`, labelled `model_name` (and `position`)), from the same snapshot.

Per-request series carry a `tenant` label (the request's tenant, `default` without tenants:
its values are the configured tenant names, so its cardinality is bounded by the config);
per-tenant gauges (running, waiting, virtual token counter) come from the same snapshot as
the rest, and requests the engine ended because their deadline passed are counted by
tenant and stage (queue: nothing was computed; running: stopped at the next step).

Beside our own `appliance_*` names, three engine gauges are also exported under vLLM's
names and label (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, each labelled `model_name`): KV-aware gateways on Kubernetes
(Gateway API Inference Extension, llm-d's endpoint picker) read exactly those when they pick
a replica. They come from the same stats snapshot as ours, so the two never disagree.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from appliance.adapters import AdapterRegistry
from engine.async_engine import AsyncEngine
from engine.request_stream import FinishedRequest
from engine.worker.status import AcceleratorStatus

if TYPE_CHECKING:
    from engine.llm_engine import EngineStats, KVTierStats

PREFIX = "appliance"

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
# Arrival to first scheduled: mostly a step or two, so finer than the latency buckets.
QUEUE_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
    2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
)  # fmt: skip


class _EngineCollector(Collector):
    """Reads the engine's snapshot at scrape time."""

    def __init__(self, aeng: AsyncEngine, adapters: AdapterRegistry | None):
        self.aeng = aeng
        self.adapters = adapters

    def collect(self) -> Iterator[Metric]:
        s = self.aeng.stats()
        gauges = (
            ("requests_running", "Requests in the running batch.", s.num_running),
            ("requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("requests_in_flight", "Requests held by the server.", self.aeng.num_in_flight),
            ("kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).", s.kv_usage),
            ("kv_cache_blocks", "KV cache blocks in total.", s.num_blocks),
            ("kv_cache_free_blocks", "KV cache blocks free.", s.num_free_blocks),
            ("engine_healthy", "1 while the engine loop is alive.", int(self.aeng.is_healthy)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield from _accelerator_metrics(self.aeng.accelerator)
        yield from _vllm_gauges(s.num_running, s.num_waiting, s.kv_usage, self.aeng.model_name)
        counters = (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits),
            ("preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions),
            ("prompt_tokens", "Prompt tokens of requests added.", s.prompt_tokens_total),
            ("generation_tokens", "Tokens generated.", s.generation_tokens_total),
            ("engine_failed_steps", "Engine steps that raised.", self.aeng.num_failed_steps),
            ("engine_steps", "Engine steps run.", self.aeng.num_steps),
        )  # fmt: skip
        for name, doc, value in counters:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        if self.adapters is not None and self.adapters.enabled:
            yield from _lora_metrics(s, self.adapters)
        if s.spec_decode is not None:
            yield from _spec_decode_metrics(s, self.aeng.model_name)
        if s.kv_tier is not None:
            yield from kv_tier_metrics(s.kv_tier, self.aeng.model_name)
        if s.tenants:
            yield from _tenant_metrics(s)


def _spec_decode_metrics(s: EngineStats, model: str) -> Iterator[Metric]:
    """Speculative decoding's counters under vLLM's names and labels (a *draft* is one
    request's proposals in one step): drafts, proposed tokens, accepted tokens, and accepted
    tokens per proposal position (`position` 0 is the first proposal). Mean acceptance
    length = 1 + accepted / drafts; acceptance rate = accepted / draft tokens."""
    spec = s.spec_decode
    assert spec is not None
    counters = (
        ("num_drafts", "Requests' proposal runs verified.", spec.num_drafts),
        ("num_draft_tokens", "Proposed tokens verified.", spec.num_draft_tokens),
        ("num_accepted_tokens", "Proposed tokens accepted.", spec.num_accepted_tokens),
    )
    for name, doc, value in counters:
        c = CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=["model_name"])
        c.add_metric([model], value)
        yield c
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted proposed tokens at each position of the proposals.",
        labels=["model_name", "position"],
    )
    for pos, value in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([model, str(pos)], value)
    yield per_pos


def _tenant_metrics(s: EngineStats) -> Iterator[Metric]:
    """Per tenant, from the engine's snapshot: requests running and waiting, and the fair
    policies' virtual token counter (weighted tokens served over the tenant's weight)."""
    running = GaugeMetricFamily(
        f"{PREFIX}_tenant_requests_running", "Requests running per tenant.", labels=["tenant"]
    )
    waiting = GaugeMetricFamily(
        f"{PREFIX}_tenant_requests_waiting", "Requests waiting per tenant.", labels=["tenant"]
    )
    counter = GaugeMetricFamily(
        f"{PREFIX}_tenant_virtual_tokens",
        "Fair policies: the tenant's virtual token counter (weighted tokens served / weight).",
        labels=["tenant"],
    )
    for name, t in sorted(s.tenants.items()):
        running.add_metric([name], t.running)
        waiting.add_metric([name], t.waiting)
        if t.virtual_tokens is not None:
            counter.add_metric([name], t.virtual_tokens)
    yield running
    yield waiting
    yield counter


def _lora_metrics(s: EngineStats, adapters: AdapterRegistry) -> Iterator[Metric]:
    """Requests per adapter (admitted, running, waiting), and vLLM's `lora_requests_info`
    under vLLM's own name, so that gateways that route by adapter (the Gateway API
    inference extension reads it) understand this server as they do vLLM: the adapters with
    running and with waiting requests as comma-separated label values, `max_lora` the
    adapter slots of a step, the value the time of the snapshot (one series, the latest)."""
    admitted = CounterMetricFamily(
        f"{PREFIX}_lora_requests",
        "Engine requests admitted per LoRA adapter (an n > 1 or batched prompt counts each).",
        labels=["adapter"],
    )
    for name, count in sorted(adapters.request_counts().items()):
        admitted.add_metric([name], count)
    yield admitted
    for state, counts in (("running", s.lora_running), ("waiting", s.lora_waiting)):
        family = GaugeMetricFamily(
            f"{PREFIX}_lora_requests_{state}",
            f"Requests {state} per LoRA adapter (adapters with none are absent).",
            labels=["adapter"],
        )
        for name, count in sorted(counts.items()):
            if count:
                family.add_metric([name], count)
        yield family
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on LoRA requests (vLLM's name and labels); the value is the time.",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    running = ",".join(sorted(n for n, c in s.lora_running.items() if c))
    waiting = ",".join(sorted(n for n, c in s.lora_waiting.items() if c))
    info.add_metric([running, waiting, str(adapters.max_loras)], time.time())
    yield info


def kv_tier_metrics(t: KVTierStats, model: str) -> Iterator[Metric]:
    """The KV tiers (docs/kv_tiers.md) in vLLM's style: `vllm:` names, `model_name` and
    `tier` ("host", "disk") labels; counters, usage gauges, the load latency histogram."""
    per_tier = (
        ("kv_tier_hit_tokens", "Prompt tokens admitted from a KV tier.", t.hit_tokens, True),
        ("kv_tier_bytes_written", "Bytes stored into a KV tier.", t.bytes_written, True),
        ("kv_tier_bytes_read", "Bytes loaded from a KV tier.", t.bytes_read, True),
        ("kv_tier_usage_bytes", "Bytes a KV tier holds.", t.usage_bytes, False),
        ("kv_tier_capacity_bytes", "Bytes a KV tier may hold.", t.capacity_bytes, False),
    )
    for name, doc, values, counter in per_tier:
        family_cls = CounterMetricFamily if counter else GaugeMetricFamily
        f = family_cls(f"vllm:{name}", doc, labels=["model_name", "tier"])
        for tier, v in sorted(values.items()):
            f.add_metric([model, tier], v)
        yield f
    perc = GaugeMetricFamily(
        "vllm:kv_tier_usage_perc",
        "KV tier usage as a fraction, 0..1.",
        labels=["model_name", "tier"],
    )
    for tier, used in sorted(t.usage_bytes.items()):
        perc.add_metric([model, tier], used / max(1, t.capacity_bytes.get(tier, 1)))
    yield perc
    singles = (
        (CounterMetricFamily, "kv_tier_query_tokens", "Prompt tokens admitted the pool lacked.", t.query_tokens),
        (CounterMetricFamily, "kv_tier_load_failures", "Blocks whose tier load failed (computed instead).", t.load_failures),
        (CounterMetricFamily, "kv_tier_saves_skipped", "Freed blocks not saved to a tier.", t.saves_skipped),
        (GaugeMetricFamily, "kv_tier_requests_loading", "Requests waiting for their KV tier loads.", t.requests_loading),
        (GaugeMetricFamily, "kv_tier_blocks_held", "KV blocks held out of the pool for saving.", t.blocks_held),
        (GaugeMetricFamily, "kv_tier_disk_failed", "1 once the disk tier was switched off by an I/O error.", int(t.disk_error is not None)),
    )  # fmt: skip
    for family_cls, name, doc, value in singles:
        f = family_cls(f"vllm:{name}", doc, labels=["model_name"])
        f.add_metric([model], value)
        yield f
    hist = HistogramMetricFamily(
        "vllm:kv_tier_load_latency_seconds",
        "Seconds from issuing a request's KV tier loads to the last one done.",
        labels=["model_name"],
    )
    cumulative, buckets = 0, []
    for bound, count in zip(
        (*t.load_latency_bounds, float("inf")), t.load_latency_counts, strict=True
    ):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    hist.add_metric([model], buckets, t.load_latency_sum)
    yield hist


def _vllm_gauges(running: int, waiting: int, kv_usage: float, model: str) -> Iterator[Metric]:
    """The queue, batch and KV gauges under vLLM's names, labelled with the served model."""
    gauges = (
        ("num_requests_running", "Requests in the running batch (vLLM's name).", running),
        ("num_requests_waiting", "Requests waiting to be scheduled (vLLM's name).", waiting),
        ("kv_cache_usage_perc", "KV cache usage as a fraction, 0..1 (vLLM's name).", kv_usage),
    )
    for name, doc, value in gauges:
        g = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
        g.add_metric([model], value)
        yield g


def _accelerator_metrics(acc: AcceleratorStatus) -> Iterator[Metric]:
    """The attention backend as an info gauge; one series per fallback, with its reason."""
    info = GaugeMetricFamily(
        f"{PREFIX}_attention_backend_info",
        "1 for the attention backend in use (flashinfer or torch).",
        labels=["backend"],
    )
    info.add_metric([acc.attention_backend], 1)
    yield info
    fallback = GaugeMetricFamily(
        f"{PREFIX}_accelerator_fallback",
        "1 per component (attention, decode_graphs) that fell back from the fast path at "
        "start-up, labelled with the reason; absent when nothing fell back.",
        labels=["component", "reason"],
    )
    for component, reason in acc.fallbacks().items():
        fallback.add_metric([component, reason], 1)
    yield fallback


class ApplianceMetrics:
    """The registry, its metrics, and the finish listener that feeds the histograms."""

    def __init__(
        self,
        aeng: AsyncEngine,
        registry: CollectorRegistry | None = None,
        adapters: AdapterRegistry | None = None,
    ):
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_finished = Counter(
            f"{PREFIX}_requests_finished",
            "Requests that left the engine, by outcome and tenant.",
            ["finish_reason", "tenant"],
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first generated token.",
            ["tenant"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time between generated tokens, per request.",
            ["tenant"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Arrival to finish.",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            f"{PREFIX}_request_queue_time_seconds",
            "Arrival to first scheduled (the engine's own timestamps).",
            ["tenant"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.expired = Counter(
            f"{PREFIX}_requests_expired",
            "Requests the engine ended because their deadline passed, by tenant and stage "
            "(queue: before any compute; running: stopped at the next step).",
            ["tenant", "stage"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            f"{PREFIX}_tenant_tokens",
            "Prompt and generated tokens of finished requests, by tenant.",
            ["tenant", "kind"],
            registry=r,
        )
        self.http_responses = Counter(
            f"{PREFIX}_http_responses",
            "HTTP responses by route and status code.",
            ["route", "status"],
            registry=r,
        )
        # A chat answer that ended inside a tool call: the cut call is left out (issue 28,
        # E15). vLLM has no counterpart to borrow a name from; named like our counters.
        self.tool_calls_dropped = Counter(
            f"{PREFIX}_tool_calls_dropped",
            "Tool calls cut short (by max_tokens, or an abort) and left out of a chat "
            "answer, by the choice's finish reason.",
            ["finish_reason"],
            registry=r,
        )
        # Embedding models: every request is one embedding input (prefill only).
        self._embeds = aeng.task == "embed"
        self.inference_time = Histogram(
            f"{PREFIX}_request_inference_time_seconds",
            "First scheduled to finished (an embedding input: its prefill).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.embedding_inputs = Counter(
            f"{PREFIX}_embedding_inputs",
            "Embedding inputs that left the engine, by outcome.",
            ["finish_reason"],
            registry=r,
        )
        self.embedding_prompt_tokens = Counter(
            f"{PREFIX}_embedding_prompt_tokens",
            "Prompt tokens of the embedding inputs that finished.",
            registry=r,
        )
        r.register(_EngineCollector(aeng, adapters))
        aeng.add_finish_listener(self.on_finished)

    def on_finished(self, f: FinishedRequest) -> None:
        """Runs on the engine thread (prometheus_client metrics are thread-safe)."""
        tenant = f.tenant
        self.requests_finished.labels(f.finish_reason, tenant).inc()
        if self._embeds:
            self.embedding_inputs.labels(f.finish_reason).inc()
            if f.finish_reason == "stop":
                self.embedding_prompt_tokens.inc(f.num_prompt_tokens)
        if f.num_prompt_tokens:
            self.tenant_tokens.labels(tenant, "prompt").inc(f.num_prompt_tokens)
        if f.num_generation_tokens:
            self.tenant_tokens.labels(tenant, "generation").inc(f.num_generation_tokens)
        m = f.metrics
        if m is None:
            return
        if m.first_scheduled_time is not None and m.finished_time is not None:
            self.inference_time.observe(max(0.0, m.finished_time - m.first_scheduled_time))
        if m.expired_time is not None:
            stage = "queue" if m.first_scheduled_time is None else "running"
            self.expired.labels(tenant, stage).inc()
        if m.first_token_time is not None:
            self.ttft.labels(tenant).observe(max(0.0, m.first_token_time - m.arrival_time))
            # Per sequence: with n > 1 the samples decode side by side.
            n = max((len(c.token_ids) for c in f.output.outputs), default=0) if f.output else 0
            if m.last_token_time is not None and n > 1:
                tpot = (m.last_token_time - m.first_token_time) / (n - 1)
                self.tpot.labels(tenant).observe(max(0.0, tpot))
        if m.first_scheduled_time is not None:
            self.queue_time.labels(tenant).observe(
                max(0.0, m.first_scheduled_time - m.arrival_time)
            )
        if m.finished_time is not None and f.finish_reason != "abort":
            self.e2e.labels(tenant).observe(max(0.0, m.finished_time - m.arrival_time))

    def render(self) -> tuple[bytes, str]:
        """Body and content type of a /metrics response."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
