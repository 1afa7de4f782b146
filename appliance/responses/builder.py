"""One sample's text, as the engine delivers it, becomes Responses output items and the
stream events that build them, in OpenAI's order:

    reasoning item:  output_item.added, content_part.added (reasoning_text),
                     reasoning_text.delta*, reasoning_text.done, content_part.done,
                     output_item.done
    message item:    output_item.added, content_part.added (output_text),
                     output_text.delta*, output_text.done, content_part.done, output_item.done
    function call:   output_item.added, function_call_arguments.delta*,
                     function_call_arguments.done, output_item.done

The text is read by the chat path's own `ChoiceStream` (appliance/dialect), so reasoning,
content and tool calls split exactly as chat completions split them. The non-streamed
answer runs the same builder and keeps only its items, so the two cannot differ.

A message is opened only when its text has something besides whitespace (the blanks a
model writes around a tool call make no empty message); a message, call or reasoning
still open when generation stops at max tokens ends `incomplete`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.dialect.chat_output import ChatDialect, ChoiceStream
from appliance.responses.items import encode_reasoning, new_id
from appliance.responses.protocol import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTextLogprob,
    ReasoningItem,
    ReasoningText,
)

Event = dict
# The engine's logprobs of a delta -> output_text logprobs (the frontend knows the tokens).
LogprobFormat = Callable[[Sequence[Any]], list[OutputTextLogprob]]


@dataclass
class _Open:
    kind: str  # message | reasoning | function_call
    id: str
    output_index: int
    text: str = ""  # message or reasoning text, or a call's arguments
    call_id: str = ""
    name: str = ""
    call_index: int = -1  # the dialect's index of the call
    logprobs: list[OutputTextLogprob] = field(default_factory=list)


class OutputBuilder:
    """Feed each engine delta with `step`; `finish` closes what is open. Both return the
    events to send (without `sequence_number`: the writer numbers them). `items` holds
    the output items finished so far."""

    def __init__(
        self,
        dialect: ChatDialect,
        logprobs: LogprobFormat | None = None,
        encrypt_reasoning: bool = False,
    ):
        self._parser = ChoiceStream(dialect)
        self._logprobs = logprobs
        self._encrypt = encrypt_reasoning
        self.items: list[OutputItem] = []
        self._open: _Open | None = None
        self._blank = ""  # whitespace that may start a message not yet opened
        self._blank_logprobs: list[OutputTextLogprob] = []

    # ---- input ------------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        """Tool calls cut short (by max tokens) and left out; the caller logs and resets."""
        return self._parser.dropped

    @dropped.setter
    def dropped(self, n: int) -> None:
        self._parser.dropped = n

    def step(
        self, text: str, logprobs: Sequence[Any] | None, finished: bool, cut: bool = False
    ) -> list[Event]:
        """One engine delta; `cut`: the last, at the length limit (a call it cut short is
        left out, the complete ones stand: issue 28, E15)."""
        events: list[Event] = []
        piece = self._parser.step(text, finished, cut)
        lps = self._logprobs(logprobs) if self._logprobs and logprobs else []
        if piece is not None and piece.reasoning:
            events += self._reasoning(piece.reasoning)
        if piece is not None and piece.content:
            events += self._content(piece.content, lps)
        elif lps:  # tokens with no text of their own yet (half a character, say)
            if self._open is not None and self._open.kind == "message":
                events += self._message_text("", lps)
            else:
                self._blank_logprobs += lps
        for t in piece.tool_calls if piece is not None else ():
            events += self._call(t.index, t.id, t.name, t.arguments)
        return events

    def finish(self, incomplete: bool) -> list[Event]:
        """Closes the open item (`incomplete`: generation stopped before its end, at max
        tokens or by a failure). A function call is only ever sent whole (a cut one is left
        out), so it closes `completed` either way."""
        whole_call = self._open is not None and self._open.kind == "function_call"
        return self._close("incomplete" if incomplete and not whole_call else "completed")

    # ---- item kinds -------------------------------------------------------------------
    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != "reasoning":
            events += self._close("completed")
            o = self._start("reasoning", new_id("rs"))
            events.append(self._added(ReasoningItem(id=o.id, status="in_progress")))
            events.append(self._part_event("response.content_part.added", ReasoningText(text="")))
        o = self._open
        assert o is not None
        o.text += text
        events.append(self._ev("response.reasoning_text.delta", content_index=0, delta=text))
        return events

    def _content(self, text: str, lps: list[OutputTextLogprob]) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != "message":
            if not (self._blank + text).strip():
                self._blank += text
                self._blank_logprobs += lps
                return events
            events += self._close("completed")
            text, self._blank = self._blank + text, ""
            lps, self._blank_logprobs = self._blank_logprobs + lps, []
            o = self._start("message", new_id("msg"))
            events.append(self._added(MessageItem(id=o.id, status="in_progress")))
            events.append(self._part_event("response.content_part.added", OutputText(text="")))
        return events + self._message_text(text, lps)

    def _message_text(self, text: str, lps: list[OutputTextLogprob]) -> list[Event]:
        o = self._open
        assert o is not None
        o.text += text
        o.logprobs += lps
        return [
            self._ev(
                "response.output_text.delta", content_index=0, delta=text,
                logprobs=[_delta_logprob(lp) for lp in lps],
            )
        ]  # fmt: skip

    def _call(self, index: int, call_id: str | None, name: str | None, args: str) -> list[Event]:
        events: list[Event] = []
        o = self._open
        if call_id is not None or o is None or o.kind != "function_call" or o.call_index != index:
            events += self._close("completed")
            o = self._start("function_call", new_id("fc"))
            o.call_id, o.name, o.call_index = call_id or new_id("call"), name or "", index
            item = FunctionCallItem(
                id=o.id, status="in_progress", call_id=o.call_id, name=o.name, arguments=""
            )
            events.append(self._added(item))
        if args:
            o.text += args
            events.append(self._ev("response.function_call_arguments.delta", delta=args))
        return events

    # ---- opening and closing ----------------------------------------------------------
    def _start(self, kind: str, item_id: str) -> _Open:
        self._open = _Open(kind, item_id, len(self.items))
        return self._open

    def _close(self, status: str) -> list[Event]:
        o = self._open  # stays open while the events below name it
        if o is None:
            return []
        events: list[Event] = []
        item: OutputItem
        if o.kind == "reasoning":
            part = ReasoningText(text=o.text)
            events.append(self._ev("response.reasoning_text.done", content_index=0, text=o.text))
            events.append(self._part_event("response.content_part.done", part))
            item = ReasoningItem(
                id=o.id, status=status, content=[part],  # type: ignore[arg-type]
                encrypted_content=encode_reasoning(o.text) if self._encrypt else None,
            )  # fmt: skip
        elif o.kind == "message":
            part = OutputText(text=o.text, logprobs=o.logprobs)
            events.append(
                self._ev(
                    "response.output_text.done", content_index=0, text=o.text,
                    logprobs=[_delta_logprob(lp) for lp in o.logprobs],
                )
            )  # fmt: skip
            events.append(self._part_event("response.content_part.done", part))
            item = MessageItem(id=o.id, status=status, content=[part])  # type: ignore[arg-type]
        else:
            events.append(
                self._ev("response.function_call_arguments.done", arguments=o.text, name=o.name)
            )
            item = FunctionCallItem(
                id=o.id, status=status, call_id=o.call_id, name=o.name,  # type: ignore[arg-type]
                arguments=o.text,
            )  # fmt: skip
        events.append(
            {"type": "response.output_item.done", "output_index": o.output_index,
             "item": _dump(item)}
        )  # fmt: skip
        self.items.append(item)
        self._open = None
        return events

    # ---- event shapes -----------------------------------------------------------------
    def _ev(self, type_: str, **fields: object) -> Event:
        o = self._open
        assert o is not None
        return {"type": type_, "item_id": o.id, "output_index": o.output_index, **fields}

    def _added(self, item: OutputItem) -> Event:
        o = self._open
        assert o is not None
        return {"type": "response.output_item.added", "output_index": o.output_index,
                "item": _dump(item)}  # fmt: skip

    def _part_event(self, type_: str, part: OutputText | ReasoningText) -> Event:
        return self._ev(type_, content_index=0, part=_dump(part))


def _dump(model: object) -> dict:
    return model.model_dump(mode="json")  # type: ignore[attr-defined]


def _delta_logprob(lp: OutputTextLogprob) -> dict:
    """A stream event's logprob: token, logprob and alternatives (no bytes, as OpenAI)."""
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp.top_logprobs],
    }
