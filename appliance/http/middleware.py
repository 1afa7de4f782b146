"""Pure ASGI middleware (no BaseHTTPMiddleware, which would buffer or break streaming).

- `AuthMiddleware`: with API keys configured, `/v1/*`, `/tokenize` and `/detokenize` need
  `Authorization: Bearer <key>`; every key is compared in constant time.
- `AccessLogMiddleware`: one structured line per request (method, route, status, duration,
  request id; never bodies) and the `appliance_http_responses_total` counter.
- `HeaderLimitMiddleware`: 431 when the request line and headers exceed
  `server.max_header_bytes`. h11 enforces the same limit only while headers are still
  arriving; a block that lands in one read is parsed whole, so the app checks it again.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.http.errors import APIError
from appliance.metrics import ApplianceMetrics
from appliance.tenancy import request_cache_salt, response_owner

logger = logging.getLogger("appliance.http.access")

_PROTECTED_EXACT = ("/tokenize", "/detokenize")


def is_protected(path: str) -> bool:
    return path.startswith("/v1/") or path == "/v1" or path in _PROTECTED_EXACT


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def api_key_of(scope: Scope) -> str | None:
    """The bearer key the request carries (AuthMiddleware has checked it when keys are on)."""
    return _bearer(scope)


def cache_salt_of(scope: Scope, user_salt: str | None, by_api_key: bool) -> tuple[str, ...]:
    """The request's prefix-cache salt (appliance.tenancy): the client's `cache_salt`, and
    its API key's hash with server.cache_salt_by_api_key (the key AuthMiddleware checked)."""
    return request_cache_salt(user_salt, _bearer(scope), by_api_key)


def owner_of(scope: Scope, keyed: bool) -> str:
    """Who owns the responses this request stores or reads (appliance.tenancy): its API key
    when the server has keys (`keyed`; AuthMiddleware checked it), else the one owner."""
    return response_owner(_bearer(scope) if keyed else None)


class AuthMiddleware:
    def __init__(self, app: ASGIApp, api_keys: Sequence[str]):
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    def _valid(self, token: str) -> bool:
        given = token.encode()
        ok = False
        for key in self.keys:  # no early exit: the time taken does not say which key matched
            ok |= hmac.compare_digest(given, key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        if is_protected(scope["path"]):
            token = _bearer(scope)
            if token is None or not self._valid(token):
                message = (
                    "Missing bearer authentication in header"
                    if token is None
                    else "Incorrect API key provided"
                )
                err = APIError(
                    401, message, "invalid_request_error", None, "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"},
                )  # fmt: skip
                return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


class HeaderLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            size += sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
            if size > self.max_bytes:
                err = APIError(
                    431, "Request line and headers are too large", "invalid_request_error",
                    None, "headers_too_large",
                )  # fmt: skip
                return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp, metrics: ApplianceMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500
        request_id = ""

        async def send_wrapper(message: Message) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                for k, v in message.get("headers", ()):
                    if k == b"x-request-id":
                        request_id = v.decode()
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = _route_template(scope)
            self.metrics.http_responses.labels(route, str(status)).inc()
            fields = {
                "method": scope.get("method"),
                "path": scope.get("path"),
                "status": status,
                "duration_ms": round((time.perf_counter() - start) * 1000, 2),
            }
            if request_id:
                fields["request_id"] = request_id
            client = scope.get("client")
            if client:
                fields["client"] = f"{client[0]}:{client[1]}"
            logger.info("http request", extra={"fields": fields})


def _route_template(scope: Scope) -> str:
    """The matched route's path (bounded label cardinality); 'unmatched' for 404s."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
