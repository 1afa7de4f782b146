"""An OTLP/HTTP trace receiver in the benchmark's own process: the served benchmarks read
each request's engine timestamps (queued, scheduled, first token, finished, deadline
expiry) and its tenant from the spans the server exports, instead of guessing them from
the client's side.

`SpanSink()` listens on 127.0.0.1 on a free port (`endpoint` is what the server's
`telemetry.otlp_endpoint` takes with `otlp_protocol: http/protobuf`) and keeps one
`RequestSpan` per request span received, by request id (`gen_ai.response.id`).
"""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class RequestSpan:
    """One request as the engine saw it: times in seconds on the server's clock."""

    request_id: str
    tenant: str
    start: float  # arrival (epoch seconds)
    queue_s: float | None  # arrival -> first scheduled (None: never scheduled)
    ttft_s: float | None  # arrival -> first token
    e2e_s: float | None  # arrival -> finished
    output_tokens: int
    expired: str | None  # "queue" / "running" when its deadline ended it
    scheduled: bool  # it got at least one step
    # The queueing and the TTFT counted in engine steps (steps begun from its arrival, the
    # one in flight then counted, to the step that first scheduled it / gave its first token).
    queue_steps: int | None = None
    ttft_steps: int | None = None


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class SpanSink:
    def __init__(self) -> None:
        self.spans: dict[str, RequestSpan] = {}
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                enc = self.headers.get("Content-Encoding", "")
                if enc == "gzip":
                    body = gzip.decompress(body)
                elif enc == "deflate":
                    body = zlib.decompress(body)
                sink._ingest(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _ingest(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        out = []
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    a = _attrs(span.attributes)
                    rid = a.get("gen_ai.response.id")
                    if rid is None or "gen_ai.operation.name" not in a:
                        continue  # the HTTP server span, not the engine's request span
                    events = {e.name: _attrs(e.attributes) for e in span.events}
                    expired = events.get("deadline_exceeded")
                    out.append(
                        RequestSpan(
                            request_id=str(rid),
                            tenant=str(a.get("appliance.tenant", "default")),
                            start=span.start_time_unix_nano / 1e9,
                            queue_s=a.get("gen_ai.latency.time_in_queue"),
                            ttft_s=a.get("gen_ai.latency.time_to_first_token"),
                            e2e_s=a.get("gen_ai.latency.e2e"),
                            output_tokens=int(a.get("gen_ai.usage.output_tokens", 0)),
                            expired=None if expired is None
                            else str(expired.get("appliance.deadline.stage")),
                            scheduled="scheduled" in events,
                            queue_steps=a.get("appliance.latency.queue_steps"),
                            ttft_steps=a.get("appliance.latency.time_to_first_token_steps"),
                        )
                    )  # fmt: skip
        with self._lock:
            for s in out:
                self.spans[s.request_id] = s

    def take(self) -> dict[str, RequestSpan]:
        """Everything received so far, and forget it."""
        with self._lock:
            out, self.spans = self.spans, {}
        return out

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
