"""What every frontend of the Responses API does before the engine sees a request, and the
two store reads it serves, written once for HTTP and gRPC: the field policy on the raw body,
the previous response (the caller's own, or a 404), the planned turn, the rendered prompt.
Errors are `ResponsesError`s; each frontend answers them in its own format.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic

from appliance.dialect.chat_output import DialectError
from appliance.dialect.prompt import render_messages
from appliance.dialect.tools_prompt import template_text
from appliance.responses.errors import ResponsesError, not_found
from appliance.responses.fields import apply_policy
from appliance.responses.protocol import ResponsesRequest
from appliance.responses.store import ResponseStore, StoredResponse
from appliance.responses.turn import Parsers, Turn, plan_turn

# AsyncEngine.offload_if_large: (size, fn, *args) -> fn(*args), on a thread when large.
Offload = Callable[..., Awaitable[Any]]


def missing(response_id: str, param: str | None = None) -> ResponsesError:
    return not_found(f"Response with id {response_id!r:.100} not found.", param)


def parse_request(data: Any) -> ResponsesRequest:
    """A request body already decoded from JSON (gRPC's; HTTP reads its own with the same
    policy and model): the field policy, then the model's checks."""
    if not isinstance(data, dict):
        raise ResponsesError("the request must be a JSON object", None, "invalid_json")
    apply_policy(data)
    try:
        return ResponsesRequest.model_validate(data, strict=True)
    except pydantic.ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("str", "list[")))
        if err["type"] == "extra_forbidden":
            raise ResponsesError(f"Unrecognized request argument supplied: {where}", where,
                                 "unknown_parameter") from None  # fmt: skip
        if err["type"] == "missing":
            raise ResponsesError(f"Missing required parameter: '{where}'", where,
                                 "missing_required_parameter") from None  # fmt: skip
        raise ResponsesError(f"Invalid value for '{where}': {err['msg']}", where) from None


async def stored(store: ResponseStore, response_id: str, owner: str) -> StoredResponse:
    """The caller's stored response, or a 404 (unknown, expired, deleted, another owner's)."""
    rec = await store.get(response_id, owner)
    if rec is None:
        raise missing(response_id)
    return rec


async def prepare(
    req: ResponsesRequest,
    store: ResponseStore,
    owner: str,
    parsers: Parsers,
    tokenizer: Any,
    offload: Offload,
) -> tuple[Turn, list[int]]:
    """The turn of `req` (continuing its previous response, if any) and its prompt ids."""
    previous = None
    if req.previous_response_id is not None:
        previous = await store.get(req.previous_response_id, owner)
        if previous is None:
            raise missing(req.previous_response_id, "previous_response_id")
        if previous.response.get("status") == "failed":
            raise ResponsesError(
                f"response {req.previous_response_id!r:.100} failed; continue from another one",
                "previous_response_id",
            )
    turn = plan_turn(req, previous, parsers, template_text(tokenizer))
    size = sum(1 + len(json.dumps(m)) for m in turn.messages)
    try:
        ids = await offload(
            size, render_messages, tokenizer, turn.messages, turn.tools, True, False,
            turn.template_kwargs,
        )  # fmt: skip
    except DialectError as e:
        raise ResponsesError(
            str(e), "input" if e.param == "messages" else e.param, e.code
        ) from None
    return turn, ids
