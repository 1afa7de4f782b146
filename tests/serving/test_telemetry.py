"""Tracing: spans built from engine timestamps, W3C context, and export to real OTLP receivers.

The unit tests record into an in-memory exporter and assert exact times and attributes. The
end-to-end tests run a real appliance (tiny model) and a real OTLP receiver on 127.0.0.1 in
this process: a gRPC one implementing the collector's TraceService, and an HTTP one taking
protobuf POSTs on /v1/traces.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.telemetry import (
    TracingSettings,
    _traces_url,
    grpc_server_interceptors,
    instrument_app,
    record_request_span,
    setup_tracing,
)
from engine.output.request_output import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from tests.support.grpc_harness import start_harness, tiny_llm_engine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
ON = TracingSettings(otlp_endpoint="unused")


def _output(finished: bool = True) -> RequestOutput:
    metrics = RequestMetrics(
        arrival_time=100.0,
        first_scheduled_time=100.25,
        first_token_time=100.5,
        last_token_time=101.5,
        finished_time=102.0,
        preempted_times=[101.0, 101.25],
        num_cached_tokens=8,
        queue_steps=2,
        ttft_steps=3,
    )
    outs = [
        CompletionOutput(0, "ab", [5, 6, 7], finish_reason="length" if finished else None),
        CompletionOutput(1, "c", [8], finish_reason="stop" if finished else None),
    ]
    return RequestOutput("req-1", "hi", [1, 2, 3, 4], outs, finished, metrics=metrics)


def _tracing_in_memory(**kw) -> tuple:
    exporter = InMemorySpanExporter()
    tracing = setup_tracing(TracingSettings(otlp_endpoint="unused", **kw), exporter=exporter)
    return tracing, exporter


def test_tracing_off_is_none_and_every_helper_is_a_no_op() -> None:
    assert setup_tracing(TracingSettings()) is None
    record_request_span(None, {"traceparent": TRACEPARENT}, _output(), operation="chat",
                        model="m", params=SamplingParams())  # fmt: skip
    app = object()
    assert instrument_app(app, None) is app
    assert grpc_server_interceptors(None) == []


def test_span_uses_engine_timestamps_and_joins_the_callers_trace() -> None:
    tracing, exporter = _tracing_in_memory()
    params = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=3, n=2, seed=1)
    record_request_span(tracing, {"Traceparent": TRACEPARENT}, _output(), operation="chat",
                        model="tiny", params=params)  # fmt: skip
    tracing.force_flush()
    (span,) = exporter.get_finished_spans()
    off = tracing.epoch_offset_ns
    assert span.name == "chat tiny" and span.kind is SpanKind.SERVER
    assert (span.start_time, span.end_time) == (100_000_000_000 + off, 102_000_000_000 + off)
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == PARENT_ID and span.parent.is_remote
    assert [(e.name, e.timestamp - off) for e in span.events] == [
        ("scheduled", 100_250_000_000),
        ("first_token", 100_500_000_000),
        ("preempted", 101_000_000_000),
        ("preempted", 101_250_000_000),
    ]
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (3, 0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.response.id"] == "req-1"
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length", "stop")
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (4, 4)
    assert a["gen_ai.usage.cache_read.input_tokens"] == 8
    assert a["appliance.request.num_preemptions"] == 2
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.25)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(0.5)
    assert a["gen_ai.latency.e2e"] == pytest.approx(2.0)
    assert (
        a["appliance.latency.queue_steps"],
        a["appliance.latency.time_to_first_token_steps"],
    ) == (2, 3)
    assert a["gen_ai.request.choice.count"] == 2 and a["gen_ai.request.seed"] == 1


def test_grpc_metadata_pairs_carry_the_context_and_binary_entries_are_ignored() -> None:
    tracing, exporter = _tracing_in_memory()
    metadata = (("x-bin", b"\x00"), ("traceparent", TRACEPARENT), ("tracestate", "k=v"))
    record_request_span(tracing, metadata, _output(), operation="text_completion",
                        model="m", params=SamplingParams())  # fmt: skip
    tracing.force_flush()
    (span,) = exporter.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert span.context.trace_state.get("k") == "v"


def test_aborted_and_failed_requests_are_marked() -> None:
    tracing, exporter = _tracing_in_memory()
    params = SamplingParams()
    record_request_span(tracing, None, _output(finished=False), operation="chat", model="m",
                        params=params, aborted=True)  # fmt: skip
    failed = _output()
    failed.error = "engine step failed"
    record_request_span(tracing, None, failed, operation="chat", model="m", params=params)
    record_request_span(tracing, None, None, operation="chat", model="m", params=params,
                        request_id="never-started", error="queue full")  # fmt: skip
    tracing.force_flush()
    aborted, errored, early = exporter.get_finished_spans()
    assert tuple(aborted.attributes["gen_ai.response.finish_reasons"]) == ("abort", "abort")
    assert not aborted.status.is_ok or aborted.status.status_code.name == "UNSET"
    assert errored.status.status_code.name == "ERROR"
    assert tuple(errored.attributes["gen_ai.response.finish_reasons"]) == ("error", "error")
    assert early.attributes["gen_ai.response.id"] == "never-started"
    assert early.status.description == "queue full"


def test_sampling_ratio_zero_drops_root_requests_but_follows_a_sampled_parent() -> None:
    tracing, exporter = _tracing_in_memory(sampling_ratio=0.0)
    for carrier in (None, {"traceparent": TRACEPARENT}):
        record_request_span(tracing, carrier, _output(), operation="chat", model="m",
                            params=SamplingParams())  # fmt: skip
    tracing.force_flush()
    (span,) = exporter.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == TRACE_ID


def test_http_exporter_url_gets_the_traces_path_only_when_none_is_given() -> None:
    assert _traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert _traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert _traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"


# ---- end to end, real receivers ------------------------------------------------------------
class _GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _HttpReceiver(BaseHTTPRequestHandler):
    requests: list[tuple[str, dict, trace_service_pb2.ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        encoding = self.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        type(self).requests.append((self.path, dict(self.headers), req))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args) -> None:
        pass


def _spans(requests) -> list:
    return [
        s for r in requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans
    ]


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = (
            [x.string_value for x in v.array_value.values]
            if kind == "array_value"
            else getattr(v, kind)
        )
    return out


@pytest.fixture(scope="module")
def grpc_receiver() -> Iterator[tuple[_GrpcReceiver, int]]:
    receiver = _GrpcReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, port
    server.stop(0)


def test_grpc_generate_exports_a_genai_span_under_the_callers_traceparent(
    tiny_llama_dir: Path, grpc_receiver
) -> None:
    receiver, port = grpc_receiver
    settings = TracingSettings(otlp_endpoint=f"http://127.0.0.1:{port}", otlp_protocol="grpc",
                               otlp_headers={"X-Tenant": "t1"}, service_name="appliance-test")  # fmt: skip
    tracing = setup_tracing(settings)
    h = start_harness(tiny_llm_engine(tiny_llama_dir), tracing=tracing, model_name="tiny")
    try:
        request = pb.GenerateRequest(
            text="The capital of France is",
            request_id="traced-1",
            sampling=pb.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, top_p=0.5),
        )

        async def call() -> list:
            async with h.channel() as ch:
                stub = pb_grpc.ApplianceStub(ch)
                md = (("traceparent", TRACEPARENT),)
                return [r async for r in stub.Generate(request, metadata=md)]

        responses = h.run(call())
        assert tracing.force_flush()
    finally:
        h.close()
        tracing.shutdown()
    usage = responses[-1].usage
    spans = _spans(receiver.requests)
    genai = [s for s in spans if s.name == "text_completion tiny"]
    rpc = [s for s in spans if s.name == "/appliance.v1.Appliance/Generate"]
    assert len(genai) == 1 and len(rpc) == 1
    for span in (genai[0], rpc[0]):
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    a = _attrs(genai[0])
    assert a["gen_ai.operation.name"] == "text_completion"
    assert (a["gen_ai.request.model"], a["gen_ai.request.max_tokens"]) == ("tiny", 5)
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (0.0, 0.5)
    assert a["gen_ai.response.id"] == "traced-1"
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens > 0
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens == 5
    assert [e.name for e in genai[0].events] == ["scheduled", "first_token"]
    assert genai[0].start_time_unix_nano <= genai[0].events[0].time_unix_nano
    assert genai[0].events[1].time_unix_nano <= genai[0].end_time_unix_nano
    resource = {
        kv.key: kv.value.string_value
        for kv in receiver.requests[0].resource_spans[0].resource.attributes
    }
    assert resource["service.name"] == "appliance-test"


def test_http_request_through_the_asgi_middleware_exports_over_otlp_http(
    tiny_llama_dir: Path,
) -> None:
    httpx = pytest.importorskip("httpx")
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    _HttpReceiver.requests = []
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _HttpReceiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    tracing = setup_tracing(TracingSettings(otlp_endpoint=endpoint, otlp_protocol="http/protobuf",
                                            otlp_headers={"Authorization": "Bearer k"}))  # fmt: skip
    h = start_harness(tiny_llm_engine(tiny_llama_dir), tracing=tracing)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def complete(request: Request) -> JSONResponse:
        last = await (await h.engine.add_request("Hello", params, "http-1")).result()
        record_request_span(tracing, request.headers, last, operation="text_completion",
                            model="m", params=params)  # fmt: skip
        return JSONResponse({"text": last.outputs[0].text})

    starlette_app = Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])
    starlette_app.state.marker = "kept"
    app = instrument_app(starlette_app, tracing)
    assert app is starlette_app and app.state.marker == "kept"

    async def call() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            r = await client.post("/v1/completions", headers={"traceparent": TRACEPARENT})
            return r.status_code

    try:
        assert h.run(call()) == 200
        assert tracing.force_flush()
    finally:
        h.close()
        tracing.shutdown()
        receiver.shutdown()
    paths = {p for p, _, _ in _HttpReceiver.requests}
    assert paths == {"/v1/traces"}
    assert all(hdrs.get("authorization") == "Bearer k" for _, hdrs, _ in _HttpReceiver.requests)
    spans = _spans(r for _, _, r in _HttpReceiver.requests)
    genai = [s for s in spans if s.name == "text_completion m"]
    http = [s for s in spans if s.name.startswith("POST")]
    assert len(genai) == 1 and len(http) == 1
    for span in (genai[0], http[0]):
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    a = _attrs(genai[0])
    assert (a["gen_ai.usage.output_tokens"], a["gen_ai.response.id"]) == (4, "http-1")


def test_a_request_ended_by_its_deadline_gets_an_event_and_the_span_names_its_tenant() -> None:
    tracing, exporter = _tracing_in_memory()
    queued = RequestOutput("q", "hi", [1], [CompletionOutput(0, "", [], "error")], True,
                           metrics=RequestMetrics(arrival_time=100.0, finished_time=101.0,
                                                  expired_time=101.0),
                           error="deadline passed")  # fmt: skip
    running = _output()
    running.metrics.expired_time = 101.75
    for out in (queued, running):
        record_request_span(tracing, None, out, operation="text_completion", model="tiny",
                            params=SamplingParams(), tenant="search")  # fmt: skip
    tracing.force_flush()
    spans = exporter.get_finished_spans()
    off = tracing.epoch_offset_ns
    expected = (("queue", 101_000_000_000), ("running", 101_750_000_000))
    for span, (stage, at) in zip(spans, expected, strict=True):
        (event,) = [e for e in span.events if e.name == "deadline_exceeded"]
        assert event.timestamp - off == at and event.attributes["appliance.deadline.stage"] == stage
        assert span.attributes["appliance.tenant"] == "search"
    assert spans[0].status.status_code is StatusCode.ERROR
