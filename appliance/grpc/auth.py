"""API-key check for every gRPC method: `authorization: Bearer <key>` metadata.

The same keys as the HTTP API. Health checks and Triton's ServerLive/ServerReady stay open
so that orchestrator probes, which cannot send metadata, keep working.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from appliance.grpc.guard import same_shape
from appliance.tenancy import Caller, Tenancy, request_cache_salt

EXEMPT_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/inference.GRPCInferenceService/ServerLive",
        "/inference.GRPCInferenceService/ServerReady",
    }
)
_MESSAGE = "a valid `authorization: Bearer <api key>` metadata entry is required"


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key.lower() != "authorization" or not isinstance(value, str):
            continue
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip().encode()
    return None


def cache_salt_of(
    metadata: Iterable[tuple[str, Any]] | None, user_salt: str | None, by_api_key: bool
) -> tuple[str, ...]:
    """The call's prefix-cache salt (appliance.tenancy): the client's `cache_salt`, and its
    API key's hash with server.cache_salt_by_api_key (the key ApiKeyInterceptor checked)."""
    return request_cache_salt(user_salt, bearer_token(metadata), by_api_key)


def caller_of(
    metadata: Iterable[tuple[str, Any]] | None,
    tenancy: Tenancy,
    timeout_s: float | None,
    arrival: float,
) -> Caller:
    """The call's tenant (by the key ApiKeyInterceptor checked), deadline and tenant salt
    (appliance.tenancy): `timeout_s` is what the call asked for (its gRPC deadline's time
    remaining, or KServe's `timeout` parameter), None for server.default_request_timeout_s."""
    return tenancy.caller(bearer_token(metadata), timeout_s, arrival)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid key with UNAUTHENTICATED, before the handler runs."""

    def __init__(self, api_keys: Iterable[str], exempt: frozenset[str] = EXEMPT_METHODS):
        self._keys = [k.encode() for k in api_keys]
        self._exempt = exempt

    def authorized(self, metadata: Iterable[tuple[str, Any]] | None) -> bool:
        token = bearer_token(metadata)
        if token is None:
            return False
        ok = False
        for key in self._keys:  # compare with every key: the time taken says nothing
            ok |= hmac.compare_digest(token, key)
        return ok

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in self._exempt:
            return handler
        if self.authorized(details.invocation_metadata):
            return handler
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

    return same_shape(handler, lambda _behavior, _unary: deny, handler.request_deserializer)
