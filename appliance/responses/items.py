"""Input items: checked one by one (errors name `input.N...`), stored in one canonical shape,
and turned into the chat messages the template renders.

The canonical shape is what `GET /v1/responses/{id}/input_items` lists and what a
continuation (`previous_response_id`) starts from: every item has an `id`; messages carry
their text as content parts (`input_text` for user, system and developer, `output_text`
for the assistant). Output items of a response are already in that shape.

Conversation rules: `function_call` items join the assistant message just before them (a
model's text and its calls are one turn); a `function_call_output` must answer a call made
earlier in the conversation; a `reasoning` item's text goes to the next assistant turn as
`reasoning_content` (what reasoning templates read). `reasoning.encrypted_content` is this
server's encoding of the reasoning text (not encryption: the same text is in `content`), so
a client without a store can send reasoning back and have it read.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from typing import Any

import pydantic

from appliance.responses.errors import ResponsesError
from appliance.responses.protocol import (
    FunctionCallIn,
    FunctionCallOutputIn,
    InputPart,
    MessageIn,
    ReasoningIn,
)

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "message": MessageIn,
    "function_call": FunctionCallIn,
    "function_call_output": FunctionCallOutputIn,
    "reasoning": ReasoningIn,
}
_TEXT_PARTS = ("input_text", "output_text", "text")
_BLOB_PREFIX = "appliance-reasoning-v1."


def new_id(prefix: str) -> str:
    """OpenAI-style ids: `msg_`, `fc_`, `rs_`, `resp_` and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def encode_reasoning(text: str) -> str:
    """`encrypted_content` of a reasoning item: the text, encoded (see the module docstring)."""
    return _BLOB_PREFIX + base64.urlsafe_b64encode(text.encode()).decode()


def decode_reasoning(blob: str, param: str) -> str:
    if blob.startswith(_BLOB_PREFIX):
        try:
            return base64.urlsafe_b64decode(blob[len(_BLOB_PREFIX) :]).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            pass
    raise ResponsesError(
        "not reasoning content this server produced (send the reasoning item's `content` instead)",
        param,
    )


def _error(e: pydantic.ValidationError, path: str) -> ResponsesError:
    err = e.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("str", "list[")))
    where = f"{path}.{loc}" if loc else path
    if err["type"] == "missing":
        return ResponsesError(
            f"Missing required parameter: '{where}'", where, "missing_required_parameter"
        )
    return ResponsesError(f"Invalid value for '{where}': {err['msg']}", where)


def _parts_text(parts: str | list[InputPart], path: str) -> str:
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if part.type in _TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        elif part.type in _TEXT_PARTS or part.type == "refusal":
            field = "refusal" if part.type == "refusal" else "text"
            raise ResponsesError(
                f"a {part.type} part needs a `{field}` string",
                f"{path}.{j}.{field}",
                "missing_required_parameter",
            )
        else:
            raise ResponsesError(
                f"only text content parts are served, got {part.type!r:.40}",
                f"{path}.{j}.type",
                "unsupported_parameter",
            )
    return "\n".join(texts)


def _message(role: str, text: str, item_id: str | None) -> dict:
    part = (
        {"type": "output_text", "text": text, "annotations": []}
        if role == "assistant"
        else {"type": "input_text", "text": text}
    )
    return {"id": item_id or new_id("msg"), "type": "message", "role": role,
            "status": "completed", "content": [part]}  # fmt: skip


def canonical_items(input_: str | list[dict[str, Any]]) -> list[dict]:
    """This request's input items in the canonical shape; ResponsesError naming `input.N`."""
    if isinstance(input_, str):
        if not input_:
            raise ResponsesError("input must not be empty", "input")
        return [_message("user", input_, None)]
    if not input_:
        raise ResponsesError("input must not be empty", "input")
    out = []
    for i, raw in enumerate(input_):
        path = f"input.{i}"
        kind = raw.get("type", "message" if "role" in raw else None)
        if not isinstance(kind, str) or kind not in _MODELS:
            known = ", ".join(ITEM_TYPES)
            if kind is None:
                raise ResponsesError(
                    f"an input item needs a `type` (one of {known})", f"{path}.type",
                    "missing_required_parameter",
                )  # fmt: skip
            raise ResponsesError(
                f"unsupported input item type {kind!r:.60}; this server reads {known}",
                f"{path}.type",
                "unsupported_parameter",
            )
        try:
            item = _MODELS[kind].model_validate(raw, strict=True)
        except pydantic.ValidationError as e:
            raise _error(e, path) from None
        if isinstance(item, MessageIn):
            out.append(_message(item.role, _parts_text(item.content, f"{path}.content"), item.id))
        elif isinstance(item, FunctionCallIn):
            out.append({"id": item.id or new_id("fc"), "type": "function_call",
                        "status": "completed", "call_id": item.call_id, "name": item.name,
                        "arguments": item.arguments})  # fmt: skip
        elif isinstance(item, FunctionCallOutputIn):
            out.append({"id": item.id or new_id("fco"), "type": "function_call_output",
                        "call_id": item.call_id,
                        "output": _parts_text(item.output, f"{path}.output")})  # fmt: skip
        else:
            assert isinstance(item, ReasoningIn)
            text = "".join(p.text for p in item.content or [])
            if not text and item.encrypted_content:
                text = decode_reasoning(item.encrypted_content, f"{path}.encrypted_content")
            if not text:
                text = "\n".join(p.text for p in item.summary)
            out.append({"id": item.id or new_id("rs"), "type": "reasoning", "summary": [],
                        "content": [{"type": "reasoning_text", "text": text}]})  # fmt: skip
    return out


def _text(item: dict) -> str:
    return "\n".join(p.get("text", p.get("refusal", "")) for p in item.get("content") or [])


def to_messages(items: list[dict], paths: list[str]) -> list[dict]:
    """The chat messages of a conversation's canonical items (`paths[i]` names item i in
    errors); a `function_call_output` whose call is not earlier is a ResponsesError."""
    msgs: list[dict] = []
    calls: dict[str, str] = {}
    reasoning: str | None = None
    prev_kind: str | None = None
    for item, path in zip(items, paths, strict=True):
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            msg = {"role": role, "content": _text(item)}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, None
            msgs.append(msg)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            joins = prev_kind in ("message", "function_call") and msgs[-1]["role"] == "assistant"
            if not joins:
                msgs.append({"role": "assistant", "content": ""})
                if reasoning:
                    msgs[-1]["reasoning_content"], reasoning = reasoning, None
            msgs[-1].setdefault("tool_calls", []).append(call)
            calls[item["call_id"]] = item["name"]
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                raise ResponsesError(
                    f"no function_call with call_id {item['call_id']!r:.80} comes before this "
                    "function_call_output",
                    f"{path}.call_id",
                )
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": item["output"]})  # fmt: skip
        elif kind == "reasoning":
            reasoning = "".join(p["text"] for p in item.get("content") or []) or None
        prev_kind = kind
    return msgs
