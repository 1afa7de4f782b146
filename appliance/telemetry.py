"""OpenTelemetry tracing: provider and OTLP export from settings, one span per request.

The engine knows nothing of OpenTelemetry; it stamps each request with `time.monotonic()`
times (`engine.output.request_output.RequestMetrics`). After a request ends, a frontend calls
`record_request_span`, which builds the request's span after the fact from those times,
converted to epoch nanoseconds with one offset captured when tracing is set up, so the span
shows the engine's own view: arrival -> scheduled -> first token -> (preempted ...) ->
finished. Its parent is the caller's W3C `traceparent` (HTTP headers or gRPC metadata),
so it joins the caller's trace next to the HTTP/gRPC server span that the ASGI middleware
or the gRPC interceptor records for the same call.

Tracing off (`otlp_endpoint` unset) costs nothing: `setup_tracing` returns None, the SDK
and exporters are never imported, and every helper here returns at once given None.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.output.request_output import RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

OTLP_PROTOCOLS = ("grpc", "http/protobuf")
_TRACER_NAME = "appliance"
# Paths the ASGI middleware does not trace (probes and scrapes would drown the requests).
_UNTRACED_PATHS = "/health,/metrics"


class TracingConfig(Protocol):
    """What `setup_tracing` reads; the YAML's `telemetry` section has these attributes."""

    otlp_endpoint: str | None
    otlp_protocol: str
    otlp_headers: Mapping[str, str]
    service_name: str
    sampling_ratio: float


@dataclass(frozen=True)
class TracingSettings:
    """Plain settings, for code that has no YAML (tests, benches)."""

    otlp_endpoint: str | None = None
    otlp_protocol: str = "grpc"  # or "http/protobuf"
    otlp_headers: Mapping[str, str] = field(default_factory=dict)
    service_name: str = "appliance"
    sampling_ratio: float = 1.0


@dataclass
class Tracing:
    """A live tracer provider plus the clock offset that maps engine times to epoch ns."""

    provider: TracerProvider
    tracer: Tracer
    # time.time_ns() - time.monotonic_ns(), captured once at set-up.
    epoch_offset_ns: int

    def epoch_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self.epoch_offset_ns

    def force_flush(self, timeout_ms: int = 10_000) -> bool:
        return self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Flushes queued spans and stops the exporter (call once at server exit)."""
        self.provider.shutdown()


def setup_tracing(config: TracingConfig, exporter: Any = None) -> Tracing | None:
    """A batch-exporting tracer provider, or None when `otlp_endpoint` is unset.

    The provider is returned, not installed globally: the middleware and interceptor get it
    explicitly. Sampling is parent-based, so a caller's sampled traceparent is honoured and
    requests without one are sampled at `sampling_ratio`. `exporter` replaces the OTLP one
    (tests).
    """
    if exporter is None and not config.otlp_endpoint:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if not 0.0 <= config.sampling_ratio <= 1.0:
        raise ValueError(
            f"telemetry.sampling_ratio: must be in [0, 1], got {config.sampling_ratio}"
        )
    provider = TracerProvider(
        resource=Resource.create({"service.name": config.service_name}),
        sampler=ParentBased(TraceIdRatioBased(config.sampling_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter or _otlp_exporter(config)))
    offset = time.time_ns() - time.monotonic_ns()
    return Tracing(provider, provider.get_tracer(_TRACER_NAME), offset)


def _otlp_exporter(config: TracingConfig) -> Any:
    endpoint = config.otlp_endpoint or ""
    headers = {k.lower(): v for k, v in dict(config.otlp_headers or {}).items()}
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not endpoint.startswith("https://")
        return OTLPSpanExporter(endpoint=endpoint, headers=headers, insecure=insecure)
    if config.otlp_protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=_traces_url(endpoint), headers=headers)
    raise ValueError(f"telemetry.otlp_protocol: must be one of {OTLP_PROTOCOLS}")


def _traces_url(endpoint: str) -> str:
    """`http://host:4318` -> `http://host:4318/v1/traces`; a URL with a path is kept."""
    scheme, sep, rest = endpoint.partition("://")
    if sep and "/" not in rest.strip("/"):
        return f"{scheme}://{rest.rstrip('/')}/v1/traces"
    return endpoint


def carrier_dict(carrier: Mapping[str, str] | Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """HTTP headers (a mapping) or gRPC metadata (key/value pairs) as a lower-cased dict."""
    if carrier is None:
        return {}
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    out = {}
    for key, value in items:
        if isinstance(value, str):  # gRPC binary (-bin) metadata is bytes: never trace context
            out[key.lower()] = value
    return out


def extract_context(carrier: Mapping[str, str] | Iterable[tuple[str, Any]] | None) -> Any:
    """The W3C trace context (`traceparent` / `tracestate`) the caller sent, if any."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier=carrier_dict(carrier))


def record_request_span(
    tracing: Tracing | None,
    carrier: Mapping[str, str] | Iterable[tuple[str, Any]] | None,
    output: RequestOutput | None,
    *,
    operation: str,
    model: str,
    params: SamplingParams | PoolingParams | None,
    request_id: str | None = None,
    error: str | None = None,
    aborted: bool = False,
    tenant: str | None = None,
) -> None:
    """Records one finished (or aborted / failed) request as a span, from engine timestamps.

    `operation` is the GenAI operation name: "chat", "text_completion", "generate_content"
    or "embeddings" (with `PoolingParams`: no sampling attributes, no output tokens).
    `output` is the last RequestOutput the frontend saw (None if the request never started).
    `tenant`: whose share it ran on (`appliance.tenant`). A request the engine ended because
    its deadline passed gets a `deadline_exceeded` event (its `appliance.deadline.stage`:
    queue or running). A no-op when `tracing` is None.
    """
    if tracing is None:
        return
    from opentelemetry.trace import SpanKind, Status, StatusCode

    now_ns = time.time_ns()
    metrics = output.metrics if output is not None else None
    start_ns = tracing.epoch_ns(metrics.arrival_time) if metrics else now_ns
    end_ns = now_ns
    if metrics is not None and metrics.finished_time is not None:
        end_ns = tracing.epoch_ns(metrics.finished_time)
    span = tracing.tracer.start_span(
        f"{operation} {model}",
        context=extract_context(carrier),
        kind=SpanKind.SERVER,
        start_time=start_ns,
        attributes=request_attributes(
            output, operation=operation, model=model, params=params, request_id=request_id,
            aborted=aborted,
        ),
    )  # fmt: skip
    if tenant is not None:
        span.set_attribute("appliance.tenant", tenant)
    if metrics is not None:
        if metrics.first_scheduled_time is not None:
            span.add_event("scheduled", timestamp=tracing.epoch_ns(metrics.first_scheduled_time))
        if metrics.first_token_time is not None:
            span.add_event("first_token", timestamp=tracing.epoch_ns(metrics.first_token_time))
        for t in metrics.preempted_times:
            span.add_event("preempted", timestamp=tracing.epoch_ns(t))
        if metrics.kv_load_start_time is not None:  # the loading state (KV tiers)
            span.add_event("kv_load_start", timestamp=tracing.epoch_ns(metrics.kv_load_start_time))
        if metrics.kv_load_end_time is not None:
            span.add_event("kv_load_end", timestamp=tracing.epoch_ns(metrics.kv_load_end_time))
        if metrics.expired_time is not None:
            stage = "queue" if metrics.first_scheduled_time is None else "running"
            span.add_event(
                "deadline_exceeded",
                timestamp=tracing.epoch_ns(metrics.expired_time),
                attributes={"appliance.deadline.stage": stage},
            )
    error = error or (output.error if output is not None else None)
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=max(end_ns, start_ns))


def request_attributes(
    output: RequestOutput | None,
    *,
    operation: str,
    model: str,
    params: SamplingParams | PoolingParams | None,
    request_id: str | None = None,
    aborted: bool = False,
) -> dict[str, Any]:
    """GenAI semantic-convention attributes plus the engine's latency breakdown."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
    }
    if isinstance(params, SamplingParams):
        _sampling_attributes(params, attrs)
    rid = request_id or (output.request_id if output is not None else None)
    if rid:
        attrs["gen_ai.response.id"] = rid
    if output is None:
        return attrs
    reasons = [c.finish_reason or ("abort" if aborted else "unknown") for c in output.outputs]
    if output.error:
        reasons = ["error"] * len(output.outputs)
    attrs["gen_ai.response.finish_reasons"] = reasons
    attrs["gen_ai.usage.input_tokens"] = len(output.prompt_token_ids)
    if output.embedding is not None:
        attrs["gen_ai.embeddings.dimension.count"] = len(output.embedding)
    elif not isinstance(params, PoolingParams):
        attrs["gen_ai.usage.output_tokens"] = sum(len(c.token_ids) for c in output.outputs)
    m = output.metrics
    if m is None:
        return attrs
    attrs["gen_ai.usage.cache_read.input_tokens"] = int(m.num_cached_tokens)
    # Where those cached tokens came from: the KV pool, or a KV tier behind it.
    from_tiers = 0
    for tier, n in sorted(m.tier_cached_tokens.items()):
        attrs[f"appliance.kv_cache.{tier}_tier_tokens"] = int(n)
        from_tiers += n
    attrs["appliance.kv_cache.pool_tokens"] = int(m.num_cached_tokens - from_tiers)
    attrs["appliance.request.num_preemptions"] = len(m.preempted_times)
    if m.first_scheduled_time is not None:
        attrs["gen_ai.latency.time_in_queue"] = m.first_scheduled_time - m.arrival_time
    if m.queue_steps is not None:  # the same waits counted in engine steps
        attrs["appliance.latency.queue_steps"] = m.queue_steps
    if m.ttft_steps is not None:
        attrs["appliance.latency.time_to_first_token_steps"] = m.ttft_steps
    if m.first_token_time is not None:
        attrs["gen_ai.latency.time_to_first_token"] = m.first_token_time - m.arrival_time
    if m.finished_time is not None:
        attrs["gen_ai.latency.e2e"] = m.finished_time - m.arrival_time
    if m.spec_num_drafts:  # speculative decoding verified proposals of this request
        attrs["appliance.spec_decode.mean_acceptance_length"] = m.spec_mean_acceptance_length
        attrs["appliance.spec_decode.num_drafts"] = m.spec_num_drafts
        attrs["appliance.spec_decode.num_draft_tokens"] = m.spec_num_draft_tokens
        attrs["appliance.spec_decode.num_accepted_tokens"] = m.spec_num_accepted_tokens
    return attrs


def _sampling_attributes(params: SamplingParams, attrs: dict[str, Any]) -> None:
    attrs["gen_ai.request.temperature"] = float(params.temperature)
    attrs["gen_ai.request.top_p"] = float(params.top_p)
    if params.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = int(params.max_tokens)
    if params.top_k:
        attrs["gen_ai.request.top_k"] = int(params.top_k)
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = int(params.seed)
    if params.n != 1:
        attrs["gen_ai.request.choice.count"] = int(params.n)


def instrument_app(app: Any, tracing: Tracing | None) -> Any:
    """Adds OpenTelemetry's ASGI middleware (one HTTP server span per request); no-op if off.

    A Starlette app gets it as its outermost middleware and is returned itself (so
    `app.state` stays reachable; call before the app starts); any other ASGI app is
    wrapped. Per-chunk send/receive spans are excluded: a streamed completion would
    otherwise make one span per SSE event.
    """
    if tracing is None:
        return app
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
    from opentelemetry.metrics import NoOpMeterProvider

    kw = {
        "excluded_urls": _UNTRACED_PATHS,
        "tracer_provider": tracing.provider,
        "meter_provider": NoOpMeterProvider(),
        "exclude_spans": ["receive", "send"],
    }
    if hasattr(app, "add_middleware"):
        app.add_middleware(OpenTelemetryMiddleware, **kw)
        return app
    return OpenTelemetryMiddleware(app, **kw)


def grpc_server_interceptors(tracing: Tracing | None) -> list[Any]:
    """OpenTelemetry's grpc.aio server interceptor (one span per RPC), or none if off."""
    if tracing is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=tracing.provider)]
