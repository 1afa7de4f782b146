"""The OpenAPI 3.1 document, generated from the same pydantic models the routes validate with.

`ROUTES` is the single table of (method, path, request model, response model, summary);
the app asserts at build time that every documented route is mounted and vice versa, so
the document cannot drift from what the server accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from appliance.http import embedding_models as em
from appliance.http import protocol as p
from appliance.responses import protocol as rp

_REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class RouteDoc:
    method: str
    path: str
    request: type[BaseModel] | None
    response: type[BaseModel] | None
    summary: str
    auth: bool
    stream: type[BaseModel] | None = None
    content_type: str = "application/json"
    # Statuses of `_ROUTE_ERRORS` this route may answer, beyond those every route may.
    errors: tuple[str, ...] = ()


ROUTES: tuple[RouteDoc, ...] = (
    RouteDoc("POST", "/v1/completions", p.CompletionRequest, p.CompletionResponse,
             "Text completion (SSE when stream is true)", True, p.CompletionStreamResponse),
    RouteDoc("POST", "/v1/chat/completions", p.ChatCompletionRequest, p.ChatCompletionResponse,
             "Chat completion with the model's chat template (SSE when stream is true)", True,
             p.ChatCompletionChunk),
    RouteDoc("POST", "/v1/responses", rp.ResponsesRequest, rp.ResponseObject,
             "OpenAI Responses: one response from input items (SSE events when stream is "
             "true); stored by default (docs/responses.md)", True),
    RouteDoc("POST", "/v1/responses/input_tokens", rp.ResponsesRequest, rp.InputTokens,
             "The input token count of a Responses request, generating nothing", True),
    RouteDoc("GET", "/v1/responses/{response_id}", None, rp.ResponseObject,
             "A stored response (404: unknown, expired, deleted or another key's)", True),
    RouteDoc("DELETE", "/v1/responses/{response_id}", None, rp.DeletedResponse,
             "Delete a stored response", True),
    RouteDoc("POST", "/v1/responses/{response_id}/cancel", None, rp.ResponseObject,
             "Cancel a background response (background mode is not served: 400)", True),
    RouteDoc("GET", "/v1/responses/{response_id}/input_items", None, rp.InputItemList,
             "The items a stored response answered, earlier turns included (limit, order, "
             "after)", True),
    RouteDoc("POST", "/v1/embeddings", em.EmbeddingRequest, em.EmbeddingResponse,
             "Embeddings of texts or token ids (an embedding model only: model.task embed)",
             True),
    RouteDoc("GET", "/v1/models", None, p.ModelList,
             "The served model and its loaded LoRA adapters", True),
    RouteDoc("GET", "/v1/models/{model}", None, p.ModelCard, "One model or adapter", True),
    RouteDoc("POST", "/v1/load_lora_adapter", p.LoadLoRAAdapterRequest, None,
             "Load a LoRA adapter from under lora.allowed_dirs (404 unless "
             "lora.allow_runtime_updates)", True, content_type="text/plain",
             errors=("403",)),
    RouteDoc("POST", "/v1/unload_lora_adapter", p.UnloadLoRAAdapterRequest, None,
             "Unload a LoRA adapter once its running requests finish (404 unless "
             "lora.allow_runtime_updates)", True, content_type="text/plain"),
    RouteDoc("POST", "/tokenize", p.TokenizeRequest, p.TokenizeResponse,
             "Token ids of a prompt or of chat messages", True),
    RouteDoc("POST", "/detokenize", p.DetokenizeRequest, p.DetokenizeResponse,
             "Text of token ids", True),
    RouteDoc("GET", "/health", None, p.HealthResponse,
             "200 while the engine is alive; the attention backend, decode graphs and the "
             "reason for any fallback", False),
    RouteDoc("GET", "/ready", None, p.StatusResponse, "200 while accepting requests", False),
    RouteDoc("GET", "/version", None, p.VersionResponse, "Server version", False),
    RouteDoc("GET", "/metrics", None, None, "Prometheus metrics", False,
             content_type="text/plain"),
    RouteDoc("POST", "/v1/completions/render", p.CompletionRequest, p.CompletionRenderResponse,
             "Prompt token ids of a completion request, generating nothing (vLLM's render, "
             "read by token-aware routers)", True),
    RouteDoc("POST", "/v1/chat/completions/render", p.ChatCompletionRequest, p.RenderedPrompt,
             "Prompt token ids of a chat request after the chat template, generating nothing",
             True),
)  # fmt: skip

_ERRORS = {
    "400": "Invalid request (the error's param names the field)",
    "401": "Missing or wrong API key",
    "404": "Unknown route, model or stored response",
    "413": "Request body too large",
    "415": "Content-Type is not application/json",
    "429": "Waiting queue full; retry later",
    "500": "The engine failed the request",
    "503": "The engine is not running or the server is shutting down",
}
_ROUTE_ERRORS = {
    "403": "lora_path is outside lora.allowed_dirs",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def build_openapi(version: str) -> dict[str, Any]:
    models = {m for r in ROUTES for m in (r.request, r.response, r.stream) if m is not None}
    models.add(p.ErrorResponse)
    inputs = [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)]
    _, defs = models_json_schema(inputs, ref_template=_REF)
    paths: dict[str, dict] = {}
    for r in ROUTES:
        op: dict[str, Any] = {"summary": r.summary, "operationId": _op_id(r)}
        if r.auth:
            op["security"] = [{"bearer": []}, {}]
        if r.request is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _ref(r.request)}},
            }
        ok: dict[str, Any] = {"description": "OK"}
        if r.response is not None:
            ok["content"] = {"application/json": {"schema": _ref(r.response)}}
            if r.stream is not None:
                ok["content"]["text/event-stream"] = {
                    "schema": {"type": "string"},
                    "description": f"`data: <{r.stream.__name__}>` events, then `data: [DONE]`",
                }
        else:
            ok["content"] = {r.content_type: {"schema": {"type": "string"}}}
        responses: dict[str, Any] = {"200": ok}
        route_errors = {code: _ROUTE_ERRORS[code] for code in r.errors}
        for code, desc in sorted({**_ERRORS, **route_errors}.items()):
            if code in ("401",) and not r.auth:
                continue
            if code in ("400", "413", "415") and r.request is None:
                continue
            responses[code] = {
                "description": desc,
                "content": {"application/json": {"schema": _ref(p.ErrorResponse)}},
            }
        op["responses"] = responses
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "appliance", "version": version,
                 "description": "OpenAI-compatible LLM inference server"},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }  # fmt: skip


def _op_id(r: RouteDoc) -> str:
    words = [w for w in r.path.strip("/").replace("{", "").replace("}", "").split("/") if w]
    return r.method.lower() + "_" + "_".join(words)
