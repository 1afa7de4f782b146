"""The small routes: models, health, readiness, version, metrics, tokenize, detokenize."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.http.body import check_content_type, parse_json, read_body
from appliance.http.chat import render_chat
from appliance.http.errors import UNAVAILABLE, APIError, bad_request
from appliance.http.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    StatusResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from appliance.http.serving import AppState, state_of
from engine.lora_request import LoRARequest


def _json(model) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


def _model_card(state: AppState, lora: LoRARequest | None = None) -> ModelCard:
    """The base model's card, or an adapter's: `parent` the base model, `root` its
    directory (as vLLM lists them)."""
    if lora is not None:
        return ModelCard(
            id=lora.lora_name,
            created=state.created,
            root=lora.lora_path,
            parent=state.model_name,
            max_model_len=state.aeng.max_model_len,
        )
    return ModelCard(
        id=state.model_name,
        created=state.created,
        root=state.aeng.config.model.path,
        max_model_len=state.aeng.max_model_len,
    )


async def list_models(request: Request) -> Response:
    state = state_of(request)
    cards = [_model_card(state)] + [_model_card(state, lo) for lo in state.adapters.adapters()]
    return _json(ModelList(data=cards))


async def retrieve_model(request: Request) -> Response:
    state = state_of(request)
    return _json(_model_card(state, state.resolve_model(request.path_params["model"])))


async def health(request: Request) -> Response:
    """200 while the engine loop is alive; 503 once it has died (liveness probe)."""
    aeng = state_of(request).aeng
    if not aeng.is_healthy:
        return APIError(
            503, f"engine is not running: {aeng.dead_reason}", UNAVAILABLE, None, "engine_dead"
        ).response()
    acc = aeng.accelerator
    return _json(
        HealthResponse(
            attention_backend=acc.attention_backend,
            attention_fallback_reason=acc.attention_fallback_reason,
            decode_graphs=acc.decode_graphs,
            graphs_fallback_reason=acc.graphs_fallback_reason,
        )
    )


async def ready(request: Request) -> Response:
    """200 when new requests are accepted; 503 while shutting down or dead (readiness)."""
    state = state_of(request)
    if state.shutting_down or not state.aeng.is_accepting:
        return APIError(503, "not accepting requests", UNAVAILABLE, None, "not_ready").response()
    return _json(StatusResponse())


async def version(request: Request) -> Response:
    return _json(VersionResponse(version=state_of(request).version))


async def metrics(request: Request) -> Response:
    body, content_type = state_of(request).metrics.render()
    return Response(body, media_type=content_type)


async def _read_and_run(request: Request, fn: Callable[[AppState, bytes], Any]) -> Any:
    """The body read, then `fn(state, raw)`: parsing, validation and the work itself, off
    the event loop when the body is large (its bytes are the whole input)."""
    state = state_of(request)
    check_content_type(request)
    raw = await read_body(request, state.server.max_request_body, state.server.body_timeout_s)
    return await state.aeng.offload_if_large(len(raw), fn, state, raw)


async def tokenize(request: Request) -> Response:
    return _json(await _read_and_run(request, _tokenize))


def _tokenize(state: AppState, raw: bytes) -> TokenizeResponse:
    req = parse_json(raw, TokenizeRequest)
    state.resolve_model(req.model)  # any served name; they share the tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
    if req.messages is not None:
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        tokens = render_chat(state, req.messages, req.add_generation_prompt)
    else:
        tokens = state.aeng.tokenizer.encode(req.prompt)
    return TokenizeResponse(
        count=len(tokens), max_model_len=state.aeng.max_model_len, tokens=tokens
    )


async def detokenize(request: Request) -> Response:
    return _json(await _read_and_run(request, _detokenize))


def _detokenize(state: AppState, raw: bytes) -> DetokenizeResponse:
    """The text of the ids; 400 naming the first id outside the vocabulary."""
    req = parse_json(raw, DetokenizeRequest)
    state.resolve_model(req.model)  # any served name; they share the tokenizer
    tokens = req.tokens
    vocab = state.aeng.tokenizer.vocab_size
    bad = next((t for t in tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary ({vocab})", "tokens")
    return DetokenizeResponse(prompt=state.aeng.tokenizer.decode(tokens))
