"""`appliance serve` end to end: HTTP and gRPC from one process, traced to a real OTLP receiver.

The server runs as a subprocess exactly as a user starts it; the test speaks OpenAI HTTP and
the native gRPC API to it at the same time, then checks that the spans the server exported
over OTLP/HTTP join the caller's trace and carry the GenAI usage attributes.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from tests.support.served_stack import spawn_serve, tiny_serve_sets
from tests.support.waiting import HANG_S

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class _Receiver(BaseHTTPRequestHandler):
    spans: list = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                type(self).spans.extend(ss.spans)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args) -> None:
        pass


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        v = kv.value
        out[kv.key] = (
            [x.string_value for x in v.array_value.values]
            if kind == "array_value"
            else getattr(v, kind)
        )
    return out


def test_serve_answers_http_and_grpc_at_once_and_traces_both(tiny_llama_dir):
    _Receiver.spans = []
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    sp = spawn_serve(
        ["serve"]
        + tiny_serve_sets(
            tiny_llama_dir,
            **{"telemetry.otlp_endpoint": endpoint, "telemetry.otlp_protocol": "http/protobuf"},
        )
    )
    try:
        url = sp.url
        body = {
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers={"traceparent": TRACEPARENT},
            timeout=HANG_S,
        )
        assert r.status_code == 200, r.text
        http_usage = r.json()["usage"]

        async def grpc_call() -> list:
            async with grpc.aio.insecure_channel(sp.grpc_address) as ch:
                req = pb.GenerateRequest(
                    text="Hello",
                    request_id="e2e-grpc",
                    sampling=pb.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                )
                md = (("traceparent", TRACEPARENT),)
                return [x async for x in pb_grpc.ApplianceStub(ch).Generate(req, metadata=md)]

        responses = asyncio.run(grpc_call())
        assert responses[-1].usage.completion_tokens == 3
        sp.proc.send_signal(signal.SIGTERM)
        assert sp.proc.wait(HANG_S) == 0  # exit flushes the span exporter
    finally:
        sp.kill()
        receiver.shutdown()

    genai = {s.name: s for s in _Receiver.spans if s.name.split()[0] in ("chat", "text_completion")}
    chat = next(s for n, s in genai.items() if n.startswith("chat "))
    gen = next(s for n, s in genai.items() if n.startswith("text_completion "))
    for span in (chat, gen):
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    a = _attrs(chat)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.usage.input_tokens"] == http_usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == http_usage["completion_tokens"] == 5
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert _attrs(gen)["gen_ai.usage.output_tokens"] == 3
