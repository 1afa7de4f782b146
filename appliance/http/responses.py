"""The Responses API over HTTP: `POST /v1/responses` (JSON or server-sent events), retrieval,
deletion, input items, cancel, and input token counts.

The work is appliance/responses' (field policy, items, turn, builder, store); this module
reads the HTTP request, renders the prompt, submits it like the chat route does (same
admission, tracing, adapters, cache salt) and answers in OpenAI's shapes. Stored responses
belong to the caller (`middleware.owner_of`: today a hash of the API key); another owner's
id is a 404, as is an unknown, expired or deleted one. Docs: docs/responses.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.http import convert
from appliance.http.body import check_content_type, parse_json, read_body, read_json
from appliance.http.caller import caller_of
from appliance.http.errors import bad_request, from_engine_error
from appliance.http.middleware import cache_salt_of, owner_of
from appliance.http.protocol import ChatLogprobToken
from appliance.http.serving import (
    AppState,
    Begun,
    ClientGone,
    SSEResponse,
    log_done,
    state_of,
    submit,
    until_disconnect,
)
from appliance.responses import service
from appliance.responses.errors import ResponsesError
from appliance.responses.fields import apply_policy
from appliance.responses.items import new_id
from appliance.responses.protocol import (
    DeletedResponse,
    InputItemList,
    InputTokens,
    OutputTextLogprob,
    ResponsesRequest,
)
from appliance.responses.run import ResponseRun
from appliance.responses.store import ResponseStore, StoredResponse
from appliance.responses.turn import Parsers, Turn

_INPUT_ITEMS_LIMIT = (1, 100, 20)  # min, max, default


def _store(state: AppState) -> ResponseStore:
    assert state.responses is not None  # build_app always sets one
    return state.responses


def _owner(state: AppState, request: Request) -> str:
    return owner_of(request.scope, bool(state.server.api_keys))


def _policy(data: dict) -> None:
    try:
        apply_policy(data)
    except ResponsesError as e:
        raise from_engine_error(e) from None


async def _stored(state: AppState, request: Request, response_id: str) -> StoredResponse:
    try:
        return await service.stored(_store(state), response_id, _owner(state, request))
    except ResponsesError as e:
        raise from_engine_error(e) from None


async def _prepare(state: AppState, request: Request, req: ResponsesRequest):  # noqa: ANN202
    parsers = Parsers(state.server.tool_parser, state.server.reasoning_parser)
    try:
        return await service.prepare(
            req, _store(state), _owner(state, request), parsers, state.aeng.tokenizer,
            state.aeng.offload_if_large,
        )  # fmt: skip
    except ResponsesError as e:
        raise from_engine_error(e) from None


def _logprob_format(state: AppState, turn: Turn):  # noqa: ANN202 - builder.LogprobFormat
    def fmt(lps) -> list[OutputTextLogprob]:  # noqa: ANN001 - the engine's TokenLogprobs
        content: list[ChatLogprobToken] = (
            convert.chat_logprobs(lps, turn.logprobs or 0, state.token_str).content or []
        )
        return [OutputTextLogprob(**t.model_dump()) for t in content]

    return fmt


async def create_response(request: Request) -> Response:
    arrival = time.monotonic()
    state = state_of(request)
    check_content_type(request)
    raw = await read_body(request, state.server.max_request_body, state.server.body_timeout_s)
    req = await state.aeng.offload_if_large(len(raw), parse_json, raw, ResponsesRequest, _policy)
    lora = state.resolve_model(req.model)
    turn, prompt_ids = await _prepare(state, request, req)
    rid = new_id("resp")
    begun = Begun(arrival, state, req, turn.params, lora, len(raw))
    (stream,) = await submit(
        request, begun, [prompt_ids], rid, "chat", map_param=turn.client_param,
        cache_salt=cache_salt_of(request.scope, req.cache_salt, state.server.cache_salt_by_api_key),
        caller=caller_of(request, state, arrival),
    )  # fmt: skip
    tok = state.aeng.tokenizer
    run = ResponseRun(
        turn, rid, state.response_model(req.model), _store(state), _owner(state, request),
        lambda ids: tok.decode(ids, skip_special_tokens=False),
        _logprob_format(state, turn),
    )  # fmt: skip
    if req.stream:
        return SSEResponse(_sse(state, run, stream), rid)

    async def drain() -> None:
        async for _ in run.events(stream):
            pass

    try:
        await until_disconnect(request, drain(), [stream])
    except ClientGone:
        return Response(status_code=499)
    finally:
        stream.abort()
    _log_done(state, run, stream)
    if run.failure is not None:
        err = from_engine_error(run.failure)
        err.param = turn.client_param(err.param)
        raise err
    return JSONResponse(run.response.model_dump(mode="json"), headers={"X-Request-Id": rid})


def _event(ev: dict) -> str:
    return f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n"


async def _sse(state: AppState, run: ResponseRun, stream) -> AsyncIterator[str]:  # noqa: ANN001
    seq = -1
    try:
        async for ev in run.events(stream):
            seq = ev["sequence_number"]
            yield _event(ev)
        _log_done(state, run, stream)
    except Exception as e:  # not the engine's failure (that is response.failed): e.g. the store
        err = from_engine_error(e)
        yield _event({"type": "error", "code": err.code, "message": err.message,
                      "param": err.param, "sequence_number": seq + 1})  # fmt: skip
    finally:
        stream.abort()


def _log_done(state: AppState, run: ResponseRun, stream) -> None:  # noqa: ANN001
    log_done(state, run.id, [stream.output()], "response", "input", lambda: run.turn.messages)


async def retrieve_response(request: Request) -> Response:
    state = state_of(request)
    if request.query_params.get("stream") in ("true", "1"):
        raise bad_request(
            "streaming a stored response is only for background responses, which are not "
            "served", "stream", "unsupported_parameter",
        )  # fmt: skip
    rec = await _stored(state, request, request.path_params["response_id"])
    return JSONResponse(rec.response)


async def delete_response(request: Request) -> Response:
    state = state_of(request)
    response_id = request.path_params["response_id"]
    if not await _store(state).delete(response_id, _owner(state, request)):
        raise from_engine_error(service.missing(response_id))
    return JSONResponse(DeletedResponse(id=response_id).model_dump(mode="json"))


async def cancel_response(request: Request) -> Response:
    state = state_of(request)
    await _stored(state, request, request.path_params["response_id"])
    raise bad_request(
        "only background responses can be cancelled, and background mode is not served",
        None, "unsupported_parameter",
    )  # fmt: skip


def _int_query(request: Request, name: str, lo: int, hi: int, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be an integer in [{lo}, {hi}]", name)
    return value


async def list_input_items(request: Request) -> Response:
    """The conversation a response answered (earlier turns included), newest first by
    default; `limit`, `order` and `after` (an item id) page through it."""
    state = state_of(request)
    lo, hi, default = _INPUT_ITEMS_LIMIT
    limit = _int_query(request, "limit", lo, hi, default)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", "order")
    rec = await _stored(state, request, request.path_params["response_id"])
    items = rec.input_items if order == "asc" else rec.input_items[::-1]
    after = request.query_params.get("after")
    if after is not None:
        ids = [it.get("id") for it in items]
        if after not in ids:
            raise bad_request(f"no input item {after!r:.80} in this response", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    body = InputItemList(
        data=page,
        first_id=page[0]["id"] if page else None,
        last_id=page[-1]["id"] if page else None,
        has_more=len(items) > limit,
    )
    return JSONResponse(body.model_dump(mode="json"))


async def count_input_tokens(request: Request) -> Response:
    """`POST /v1/responses/input_tokens`: the prompt's token count, generating nothing."""
    state = state_of(request)
    req = await read_json(
        request, ResponsesRequest, state.server.max_request_body, state.server.body_timeout_s,
        offload=state.aeng.offload_if_large, prepare=_policy,
    )  # fmt: skip
    state.resolve_model(req.model)
    _, ids = await _prepare(state, request, req)
    return JSONResponse(InputTokens(input_tokens=len(ids)).model_dump(mode="json"))
