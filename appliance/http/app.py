"""The Starlette app: routes from the OpenAPI table, error handlers, middleware, state.

`build_app` does not own the AsyncEngine (several frontends may share it); whoever made
the engine shuts it down. The middleware order, outermost first: CORS (only when
configured, so preflights never need a key), access log, header size limit, API-key check,
the router.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from appliance.adapters import AdapterRegistry
from appliance.config import ServerConfig
from appliance.config.schema import LoRASection
from appliance.http import adapters, responses, routes
from appliance.http.chat import create_chat_completion
from appliance.http.completions import create_completion
from appliance.http.embeddings import create_embedding
from appliance.http.errors import (
    APIError,
    api_error_handler,
    client_disconnect_handler,
    http_exception_handler,
    unhandled_error_handler,
)
from appliance.http.middleware import (
    AccessLogMiddleware,
    AuthMiddleware,
    HeaderLimitMiddleware,
)
from appliance.http.openapi import ROUTES, build_openapi
from appliance.http.render import render_chat_completion, render_completion
from appliance.http.serving import AppState
from appliance.http.tracing_hook import HttpRequestTracer
from appliance.metrics import ApplianceMetrics
from appliance.responses.store import ResponseStore, memory_store
from appliance.telemetry import Tracing
from engine.async_engine import AsyncEngine

ENDPOINTS = {
    ("POST", "/v1/completions"): create_completion,
    ("POST", "/v1/chat/completions"): create_chat_completion,
    ("POST", "/v1/responses"): responses.create_response,
    ("POST", "/v1/responses/input_tokens"): responses.count_input_tokens,
    ("GET", "/v1/responses/{response_id}"): responses.retrieve_response,
    ("DELETE", "/v1/responses/{response_id}"): responses.delete_response,
    ("POST", "/v1/responses/{response_id}/cancel"): responses.cancel_response,
    ("GET", "/v1/responses/{response_id}/input_items"): responses.list_input_items,
    ("POST", "/v1/embeddings"): create_embedding,
    ("GET", "/v1/models"): routes.list_models,
    ("GET", "/v1/models/{model}"): routes.retrieve_model,
    ("POST", "/v1/load_lora_adapter"): adapters.load_lora_adapter,
    ("POST", "/v1/unload_lora_adapter"): adapters.unload_lora_adapter,
    ("POST", "/tokenize"): routes.tokenize,
    ("POST", "/detokenize"): routes.detokenize,
    ("GET", "/health"): routes.health,
    ("GET", "/ready"): routes.ready,
    ("GET", "/version"): routes.version,
    ("GET", "/metrics"): routes.metrics,
    ("POST", "/v1/completions/render"): render_completion,
    ("POST", "/v1/chat/completions/render"): render_chat_completion,
}


def build_app(
    aeng: AsyncEngine,
    server: ServerConfig | None = None,
    version: str | None = None,
    metrics: ApplianceMetrics | None = None,
    tracing: Tracing | None = None,
    adapters: AdapterRegistry | None = None,
    responses_store: ResponseStore | None = None,
) -> Starlette:
    """An ASGI app serving `aeng`; `metrics` defaults to a fresh per-app registry, `adapters`
    (shared with the gRPC frontend) to none and no runtime loading, `responses_store` (shared
    with gRPC too; its owner closes it) to an in-memory store with the default bounds."""
    server = server or ServerConfig()
    version = version or _package_version()
    documented = {(r.method, r.path) for r in ROUTES}
    assert documented == set(ENDPOINTS), documented ^ set(ENDPOINTS)
    adapters = adapters or AdapterRegistry(aeng, LoRASection(), aeng.model_name)
    metrics = metrics or ApplianceMetrics(aeng, adapters=adapters)
    state = AppState(aeng=aeng, server=server, metrics=metrics, version=version, adapters=adapters)
    state.responses = responses_store or memory_store()
    if tracing is not None:
        state.tracer = HttpRequestTracer(tracing, aeng)
    openapi = build_openapi(version)

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(openapi)

    route_list = [Route(path, fn, methods=[method]) for (method, path), fn in ENDPOINTS.items()]
    route_list.append(Route("/openapi.json", openapi_json, methods=["GET"]))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        state.shutting_down = True  # /ready turns 503 while connections drain

    middleware = []
    if server.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(server.cors_origins),
                allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                allow_headers=["Authorization", "Content-Type"],
            )
        )
    middleware.append(Middleware(AccessLogMiddleware, metrics=metrics))
    middleware.append(Middleware(HeaderLimitMiddleware, max_bytes=server.max_header_bytes))
    middleware.append(Middleware(AuthMiddleware, api_keys=server.api_keys))
    app = Starlette(
        routes=route_list,
        middleware=middleware,
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_exception_handler,
            ClientDisconnect: client_disconnect_handler,
            Exception: unhandled_error_handler,
        },
        lifespan=lifespan,
    )
    app.state.appliance = state
    return app


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    try:
        return pkg_version("appliance")
    except PackageNotFoundError:
        return "0.0.0+local"
