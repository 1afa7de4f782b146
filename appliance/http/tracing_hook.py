"""Request spans for the HTTP frontend, recorded when the engine finishes a request.

`submit` registers each engine request id with the caller's headers (for `traceparent`)
and its sampling parameters; the AsyncEngine's finish listener then records the span from
the engine's own timestamps, whatever way the request ended (finished, aborted, failed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from appliance.telemetry import Tracing, record_request_span
from engine.async_engine import AsyncEngine
from engine.pooling_params import PoolingParams
from engine.request_stream import FinishedRequest
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class _Pending:
    headers: dict[str, str]
    params: SamplingParams | PoolingParams
    operation: str


class HttpRequestTracer:
    def __init__(self, tracing: Tracing, aeng: AsyncEngine):
        self.tracing = tracing
        self.model = aeng.model_name
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()  # listeners run on the engine thread
        aeng.add_finish_listener(self.on_finished)

    def register(
        self,
        request_id: str,
        headers: dict[str, str],
        params: SamplingParams | PoolingParams,
        operation: str,
    ) -> None:
        carrier = {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
        with self._lock:
            self._pending[request_id] = _Pending(carrier, params, operation)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def on_finished(self, f: FinishedRequest) -> None:
        with self._lock:
            pending = self._pending.pop(f.request_id, None)
        if pending is None:
            return
        record_request_span(
            self.tracing,
            pending.headers,
            f.output,
            operation=pending.operation,
            model=self.model,
            params=pending.params,
            request_id=f.request_id,
            error=(f.output.error if f.output is not None else None),
            aborted=f.finish_reason == "abort",
            tenant=f.tenant,
        )
