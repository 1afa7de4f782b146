"""The native `Chat` prompt: messages, tools and tool_choice read from the proto, and each
sample's text read back as reasoning, content and tool calls.

The dialect (appliance/dialect) is the one HTTP chat uses: the same server parsers
(`server.tool_parser`, `server.reasoning_parser`), the same fallback prompt for templates
without tools, the same grammar for a forced call. Errors name `chat.<field>`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import pydantic

from appliance.dialect.chat_output import (
    ChatDialect,
    ChoiceStream,
    DialectError,
    chat_dialect,
    finish_reason,
)
from appliance.dialect.tools_prompt import template_inputs, template_text
from appliance.grpc.errors import invalid
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.http.protocol import CHAT_ROLES, ToolDef

TOOL_CHOICE_MODES = ("none", "auto", "required")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatParsers:
    """The server's parsers (the YAML's `server.tool_parser`, `server.reasoning_parser`)."""

    tool_parser: str = "auto"
    reasoning_parser: str = "none"


def chat_messages(chat: pb.Chat) -> list[dict]:
    """The template's messages, in OpenAI's shape; roles are those the HTTP API takes
    (`developer` is read as `system`, as there)."""
    if not chat.messages:
        raise invalid("chat.messages", "must not be empty")
    out = []
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise invalid(
                f"chat.messages.{i}.role",
                f"must be one of {', '.join(CHAT_ROLES)}, got {m.role!r:.40}",
            )
        msg: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.content}
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ]  # fmt: skip
        out.append(msg)
    return out


def _tool(i: int, t: pb.Tool) -> dict:
    """One tool as OpenAI's dict, checked by the HTTP API's model (name pattern and all)."""
    fn: dict = {"name": t.name}
    if t.description:
        fn["description"] = t.description
    if t.parameters:
        try:
            fn["parameters"] = json.loads(t.parameters)
        except ValueError as e:
            raise invalid(f"chat.tools.{i}.parameters", f"not JSON: {e}") from None
        if not isinstance(fn["parameters"], dict):
            raise invalid(f"chat.tools.{i}.parameters", "must be a JSON object")
    try:
        ToolDef.model_validate({"type": "function", "function": fn})
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        raise invalid(f"chat.tools.{i}.{err['loc'][-1]}", err["msg"]) from None
    return {"type": "function", "function": fn}


def _tool_choice(chat: pb.Chat) -> str | dict | None:
    if not chat.HasField("tool_choice"):
        return None
    kind = chat.tool_choice.WhichOneof("choice")
    if kind == "function":
        return {"type": "function", "function": {"name": chat.tool_choice.function}}
    mode = chat.tool_choice.mode
    if mode not in TOOL_CHOICE_MODES:
        raise invalid(
            "chat.tool_choice.mode",
            f"must be one of {', '.join(TOOL_CHOICE_MODES)}, got {mode!r:.40}",
        )
    return mode


def dialect_of(chat: pb.Chat, parsers: ChatParsers, tokenizer: object) -> ChatDialect:
    """The request's tools, tool_choice and reasoning under the server's parsers."""
    tools = [_tool(i, t) for i, t in enumerate(chat.tools)] or None
    try:
        return chat_dialect(
            tools,
            _tool_choice(chat),
            chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None,
            parsers.tool_parser,
            parsers.reasoning_parser,
            template_text(tokenizer),
            enable_thinking=not chat.HasField("enable_thinking") or chat.enable_thinking,
        )
    except DialectError as e:
        raise as_invalid(e) from None


def as_invalid(e: DialectError) -> Exception:
    # `stop` is a sampling field in the proto; the dialect's other fields live in `chat`.
    return invalid("sampling.stop" if e.param == "stop" else f"chat.{e.param}", str(e))


def template_call(chat: pb.Chat, dialect: ChatDialect, tokenizer: object) -> tuple[list, dict]:
    """(messages, keyword arguments) for `tokenizer.apply_chat_template`."""
    messages, kw = template_inputs(chat_messages(chat), dialect.tools, tokenizer)
    kw["add_generation_prompt"] = (
        chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    )
    if chat.HasField("enable_thinking"):
        kw["enable_thinking"] = chat.enable_thinking
    return messages, kw


@dataclass
class ChatReader:
    """Reads each sample's deltas through its own ChoiceStream and fills the response's
    `content`, `reasoning_content`, `tool_calls` and finish_reason."""

    dialect: ChatDialect
    streams: dict[int, ChoiceStream] = field(default_factory=dict)

    def fill(self, resp: pb.GenerateResponse, text: str, reason: str | None) -> None:
        p = self.streams.setdefault(resp.index, ChoiceStream(self.dialect))
        piece = p.step(text, reason is not None, reason == "length")
        if p.dropped:  # the complete calls are answered; the cut one is said, not silent
            logger.warning(
                "tool call cut short was dropped",
                extra={"fields": {"request_id": resp.request_id, "index": resp.index,
                                  "dropped": p.dropped, "finish_reason": reason}},
            )  # fmt: skip
            p.dropped = 0
        if piece is not None:
            resp.content = piece.content
            resp.reasoning_content = piece.reasoning
            for t in piece.tool_calls:
                resp.tool_calls.add(index=t.index, id=t.id or "", name=t.name or "",
                                    arguments=t.arguments or "")  # fmt: skip
        resp.finish_reason = finish_reason(reason, p.called) or ""
