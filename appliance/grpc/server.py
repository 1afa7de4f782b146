"""The gRPC server: native + KServe services, health, reflection, auth and tracing.

`start_grpc_server` runs on the caller's event loop, next to the HTTP server, sharing one
AsyncEngine. Health reports SERVING for the server ("") and each service only while the
engine is healthy and accepting work; a small task re-checks it until the server stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from appliance.adapters import AdapterRegistry
from appliance.config.schema import LoRASection
from appliance.grpc.auth import ApiKeyInterceptor
from appliance.grpc.guard import GuardInterceptor
from appliance.grpc.kserve import KServeServicer
from appliance.grpc.native import ApplianceServicer
from appliance.grpc.native_chat import ChatParsers
from appliance.grpc.proto._pool import reflection_pool
from appliance.grpc.proto.appliance.v1 import appliance_pb2, appliance_pb2_grpc
from appliance.grpc.proto.inference import grpc_service_pb2_grpc
from appliance.responses.store import ResponseStore
from appliance.telemetry import Tracing, grpc_server_interceptors
from appliance.tenancy import Tenancy

logger = logging.getLogger(__name__)

NATIVE_SERVICE = "appliance.v1.Appliance"
KSERVE_SERVICE = "inference.GRPCInferenceService"
HEALTH_SERVICE = "grpc.health.v1.Health"
SERVICES = (NATIVE_SERVICE, KSERVE_SERVICE)


@dataclass(frozen=True)
class GrpcSettings:
    """What the gRPC frontend needs from the YAML (`server.*`, `model.served_name`)."""

    host: str = "127.0.0.1"
    # 0 picks a free port; the bound one is `server.bound_port` and is logged.
    port: int = 50051
    # Empty: no authentication.
    api_keys: tuple[str, ...] = ()
    # The name clients address the model by; None: the engine's `model_name`.
    model_name: str | None = None
    # Largest request message (the YAML's server.max_request_body); larger ones are refused
    # with RESOURCE_EXHAUSTED before a handler runs.
    max_receive_bytes: int = 8 * 1024 * 1024
    max_message_bytes: int = 16 * 1024 * 1024  # largest response message
    # Calls gRPC core may hold before a handler takes them (the YAML's
    # server.grpc_max_pending_calls). Core sheds a backlog past its own default (1,000, some
    # at random, all past 3,000) as CANCELLED, which clients do not retry; under this bound
    # every call reaches admission, and overload is answered RESOURCE_EXHAUSTED.
    max_pending_calls: int = 16384
    # Salt every call's prefix-cache entries by its API key (appliance.tenancy).
    cache_salt_by_api_key: bool = False
    # API key -> tenant, deadlines, tenant salts (server.tenants and friends); None: no
    # tenants, no default deadline.
    tenancy: Tenancy | None = None
    # The chat dialect's parsers (server.tool_parser, server.reasoning_parser).
    chat_parsers: ChatParsers = ChatParsers()
    # How often health re-reads the engine's state.
    health_poll_s: float = 1.0
    server_version: str = "0.1.0"

    @classmethod
    def from_server_config(cls, server: Any, **overrides: Any) -> GrpcSettings:
        """From the YAML's `server` section (host, grpc_port, api_keys, max_request_body)."""
        return cls(
            host=server.host,
            port=server.grpc_port,
            api_keys=tuple(server.api_keys),
            max_receive_bytes=server.max_request_body,
            max_pending_calls=server.grpc_max_pending_calls,
            cache_salt_by_api_key=server.cache_salt_by_api_key,
            chat_parsers=ChatParsers(server.tool_parser, server.reasoning_parser),
            tenancy=Tenancy(server),
            **overrides,
        )


def _serving(async_engine: Any) -> bool:
    accepting = getattr(async_engine, "is_accepting", None)
    return bool(async_engine.is_healthy if accepting is None else accepting)


async def _set_health(servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", *SERVICES):
        await servicer.set(name, status)


async def _watch_health(
    server: grpc.aio.Server, servicer: health.aio.HealthServicer, async_engine: Any, poll_s: float
) -> None:
    """Mirrors the engine's health into the health service until the server stops."""
    serving = _serving(async_engine)
    await _set_health(servicer, serving)
    while await server.wait_for_termination(timeout=poll_s):  # True: timed out, still up
        now = _serving(async_engine)
        if now != serving:
            serving = now
            logger.info("grpc health changed", extra={"fields": {"serving": serving}})
            await _set_health(servicer, serving)


def _interceptors(settings: GrpcSettings, tracing: Tracing | None) -> list[Any]:
    # Tracing first, so that rejected calls are traced too; the guard innermost, around the
    # handlers themselves.
    out: list[Any] = list(grpc_server_interceptors(tracing))
    if settings.api_keys:
        out.append(ApiKeyInterceptor(settings.api_keys))
    out.append(GuardInterceptor())
    return out


async def start_grpc_server(
    async_engine: Any,
    settings: GrpcSettings,
    tracing: Tracing | None = None,
    adapters: AdapterRegistry | None = None,
    responses_store: ResponseStore | None = None,
) -> grpc.aio.Server:
    """Builds, binds and starts the server on the running loop; stop it with `server.stop(grace)`.

    `adapters` (shared with the HTTP frontend): the LoRA adapters a call may select; none
    when not given. `responses_store` (shared with HTTP too): where Respond keeps responses;
    an in-memory one when not given. The bound port (useful with port 0) is set as `server.bound_port`.
    """
    model = settings.model_name or async_engine.model_name
    adapters = adapters or AdapterRegistry(async_engine, LoRASection(), model)
    options: Iterable[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", settings.max_receive_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.server.max_pending_requests", settings.max_pending_calls),
        ("grpc.server.max_pending_requests_hard_limit", settings.max_pending_calls),
    ]
    server = grpc.aio.server(interceptors=_interceptors(settings, tracing), options=options)
    appliance_pb2_grpc.add_ApplianceServicer_to_server(
        ApplianceServicer(
            async_engine,
            model,
            tracing,
            settings.cache_salt_by_api_key,
            settings.chat_parsers,
            adapters,
            responses_store,
            keyed=bool(settings.api_keys),
            tenancy=settings.tenancy,
        ),  # fmt: skip
        server,
    )
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
        KServeServicer(
            async_engine,
            model,
            tracing,
            settings.server_version,
            settings.cache_salt_by_api_key,
            adapters,
            settings.tenancy,
        ),  # fmt: skip
        server,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    pool = reflection_pool(
        appliance_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR
    )
    names = (*SERVICES, HEALTH_SERVICE, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server, pool=pool)
    address = f"{settings.host}:{settings.port}"
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"grpc: could not bind {address}")
    await server.start()
    server.bound_port = port  # type: ignore[attr-defined]
    await _set_health(health_servicer, _serving(async_engine))
    task = asyncio.create_task(
        _watch_health(server, health_servicer, async_engine, settings.health_poll_s),
        name="grpc-health",
    )
    server.health_task = task  # type: ignore[attr-defined]  # keep a reference
    logger.info(
        "grpc listening",
        extra={
            "fields": {
                "host": settings.host,
                "port": port,
                "model": model,
                "auth": bool(settings.api_keys),
                "tracing": tracing is not None,
            }
        },
    )
    return server
