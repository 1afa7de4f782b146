"""One chat request's dialect: what the template gets, what constraint the engine gets, and
how each choice's text becomes reasoning, content and tool calls (whole or streamed).

Shared by every chat frontend, so tool calls and reasoning read the same over HTTP and gRPC.
Pipeline per choice: the reasoning splitter first (`<think>…</think>`), then the tool-call
scanner over what is left (the answer proper).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.dialect.reasoning import (
    THINK_END,
    THINK_START,
    AnswerStart,
    ReasoningStream,
    answer_start,
)
from appliance.dialect.tool_grammar import tool_call_constraint
from appliance.dialect.tool_parsers import ToolCall, ToolCallStream, ToolDelta, parse_tool_calls
from appliance.dialect.tools_prompt import parser_for_template
from engine.sampling_params import SamplingParams, StructuredOutputsParams


class DialectError(ValueError):
    """A request the dialect cannot serve: `param` names the field, `code` the OpenAI error
    code (a 400)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ChatDialect:
    """What one chat request needs: tools (None: not offered), the parser that reads calls,
    whether calls are forced (`required` or a named function), the reasoning parser."""

    tools: list[dict] | None = None
    tool_parser: str | None = None
    forced: list[dict] | None = None  # the tools a call must be one of
    parallel: bool = True
    reasoning_parser: str | None = None
    # Where the answer starts, read from the rendered prompt (`for_prompt`); None: the
    # reasoning parser's own rule.
    answer_start: AnswerStart | None = None

    @property
    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools or []}

    def allowed_calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        """`parallel_tool_calls: false` means one call; a forced call's grammar allows only
        one, but under `auto` nothing holds the model to it, so the first call is kept and
        the rest left out, as vLLM does (issue 28, E15)."""
        return calls if self.parallel else calls[:1]

    def reasoning_stream(self) -> ReasoningStream | None:
        """The splitter of one choice's text, None without a reasoning parser."""
        if self.reasoning_parser is None:
            return None
        return ReasoningStream(self.reasoning_parser, self.answer_start)

    def start(self) -> dict:
        """Where an output constraint starts (`StructuredOutputsParams` fields): after the
        reasoning section when the answer starts in it, at once when it has none, and, when
        the first token decides (qwen3), after it only if that token opens one."""
        if self.reasoning_parser is None:
            return {}
        where = self.reasoning_stream().start  # type: ignore[union-attr]
        if where == "content":
            return {}
        if where == "reasoning":
            return {"start_after": THINK_END}
        return {"start_after": THINK_END, "opened_by": THINK_START}

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that enforces a forced call (after the reasoning section, if any)."""
        if not self.forced or self.tool_parser is None:
            return None
        return dataclasses.replace(
            tool_call_constraint(self.forced, self.tool_parser, self.parallel, None),
            **self.start(),
        )


# How much of the rendered prompt's end is read for where the answer starts.
_TAIL_TOKENS = 16


def for_prompt(dialect: ChatDialect, tokenizer: Any, prompt_ids: Sequence[int]) -> ChatDialect:
    """The dialect of a request whose rendered prompt is `prompt_ids`: where its answer
    starts (`answer_start` of the prompt's last tokens, as text with special tokens)."""
    if dialect.reasoning_parser is None:
        return dialect
    tail = tokenizer.decode(list(prompt_ids[-_TAIL_TOKENS:]), skip_special_tokens=False)
    return dataclasses.replace(dialect, answer_start=answer_start(dialect.reasoning_parser, tail))


def chat_dialect(
    tools: list[dict] | None,
    tool_choice: str | dict | None,
    parallel_tool_calls: bool | None,
    server_tool_parser: str,
    server_reasoning_parser: str,
    template: str | None,
    enable_thinking: bool = True,
) -> ChatDialect:
    """The dialect of a request from its fields and the server's parsers; DialectError for a
    `tool_choice` naming no declared tool, or tools sent to a server with `tool_parser: none`."""
    reasoning = (
        None
        if server_reasoning_parser == "none" or not enable_thinking
        else (server_reasoning_parser)
    )
    choice = "auto" if tool_choice is None else tool_choice
    if not tools:
        if choice not in ("none", "auto"):
            raise DialectError("tool_choice needs tools", "tool_choice")
        return ChatDialect(reasoning_parser=reasoning)
    if server_tool_parser == "none":
        raise DialectError("tool calling is off on this server (server.tool_parser: none)", "tools")
    parser = parser_for_template(template) if server_tool_parser == "auto" else server_tool_parser
    if choice == "none":
        return ChatDialect(tools=tools, reasoning_parser=reasoning)
    forced = None
    if choice == "required":
        forced = tools
    elif isinstance(choice, dict):
        name = choice["function"]["name"]
        forced = [t for t in tools if t["function"]["name"] == name]
        if not forced:
            raise DialectError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return ChatDialect(
        tools=tools,
        tool_parser=parser,
        forced=forced,
        parallel=parallel_tool_calls is not False and not isinstance(choice, dict),
        reasoning_parser=reasoning,
    )


def constrain(params: SamplingParams, dialect: ChatDialect) -> None:
    """Puts the dialect's needs on the engine request: the grammar of a forced tool call,
    a constraint that starts after the reasoning section, special tokens kept where the
    parser reads them (`[TOOL_CALLS]`, `<|python_tag|>`). DialectError when a forced call
    meets another output constraint (`tool_choice`) or stop strings (`stop`)."""
    forced = dialect.constraint()
    if forced is not None:
        if params.stop:
            # A stop string can match inside the call (`"`, `{`) and end the choice with a
            # cut call labelled "stop": refused rather than honored halfway (issue 28, E14).
            raise DialectError(
                "stop strings cannot be combined with a tool_choice that forces a call "
                "(a stop string could cut the call)",
                "stop",
            )
        if params.structured_outputs is not None:
            raise DialectError(
                "a tool_choice that forces a call cannot be combined with another output "
                "constraint (response_format, structured_outputs)",
                "tool_choice",
            )
        params.structured_outputs = forced
    elif params.structured_outputs is not None and dialect.reasoning_parser is not None:
        if params.structured_outputs.start_after is None:
            params.structured_outputs = dataclasses.replace(
                params.structured_outputs, **dialect.start()
            )
    if dialect.tool_parser in ("mistral", "llama3"):
        params.skip_special_tokens = False


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that stops after its tool calls finishes with `tool_calls`."""
    return "tool_calls" if called and reason == "stop" else reason


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolDelta] = field(default_factory=list)


@dataclass
class ChoiceResult:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    dropped: int = 0  # tool calls cut short by the length limit and left out


class ChoiceStream:
    """One streamed choice: `feed` each text delta, `finish` at its end.

    A forced call (`required`, a named function) is grammar-enforced, so it cannot turn out
    malformed, but it can be cut by max_tokens, and a stream cannot take back what it sent:
    so each call is held until its arguments' JSON closes, then sent whole (id and name,
    then its arguments); a call still open when the choice ends is never sent and is counted
    in `dropped` (issue 28, E15). A client's stream helper (the openai SDK's) then never
    assembles a call whose arguments are broken JSON. Under `auto` a call may turn out
    malformed, so once the answer enters a call section, everything after it is held until
    the choice ends, then sent either as tool calls (each: id and name, then its arguments)
    or, if any call is malformed, as content.
    """

    def __init__(self, dialect: ChatDialect):
        self.dialect = dialect
        self.reasoning = dialect.reasoning_stream()
        self.tools = ToolCallStream(dialect.tool_parser) if dialect.tool_parser else None
        self._answer_text = ""  # the answer (after any reasoning) so far
        self._sent_content = ""
        self._holding = False
        self._held_calls: list[ToolCall] = []
        self.dropped = 0  # calls cut short (by the length limit) and never sent
        self._sent_calls = 0  # a forced answer's calls sent so far (each one whole)

    @property
    def called(self) -> bool:
        if self.dialect.forced:
            return self._sent_calls > 0
        return bool(self._held_calls)

    def _answer(self, out: ChoiceDelta, text: str, end: bool, cut: bool = False) -> ChoiceDelta:
        if self.tools is None:
            out.content += text
            return out
        self._answer_text += text
        if self.dialect.forced:
            out.content += self.tools.feed(text).content
            if end:
                out.content += self.tools.finish(cut).content
            self._send_complete_calls(out, end)
            return out
        if not self._holding:
            d = self.tools.feed(text)
            if d.tool_calls or self.tools.in_calls or self.tools.calls:
                self._holding = True  # from here on nothing is sent until the end
            out.content += d.content
            self._sent_content += d.content
        if end:
            self._release(out, cut)
        return out

    def _send_complete_calls(self, out: ChoiceDelta, end: bool) -> None:
        """A forced answer: send each call whose arguments have closed, whole; at the end a
        call still open (cut) is left out and counted in `dropped`."""
        calls = self.tools.calls  # type: ignore[union-attr]
        done = len(calls) - (1 if self.tools.args_start is not None else 0)  # type: ignore[union-attr]
        for i in range(self._sent_calls, done):
            out.tool_calls.append(ToolDelta(i, calls[i].id, calls[i].name, ""))
            out.tool_calls.append(ToolDelta(i, arguments=calls[i].arguments))
        self._sent_calls = max(self._sent_calls, done)
        if end:
            self.dropped = self.tools.dropped + len(calls) - self._sent_calls  # type: ignore[union-attr]

    def _release(self, out: ChoiceDelta, cut: bool) -> None:
        """The choice ended: send what was held, as calls if they all parse, else as text;
        `cut` (finish "length"): a call cut short is dropped, the complete ones sent."""
        if not self._holding:
            f = self.tools.finish()  # type: ignore[union-attr]
            out.content += f.content
            return
        parsed = parse_tool_calls(
            self._answer_text,
            self.dialect.tool_parser,  # type: ignore[arg-type]
            self.dialect.tool_names,
            cut,
        )
        self.dropped = parsed.dropped
        parsed.tool_calls = self.dialect.allowed_calls(parsed.tool_calls)
        content = parsed.content or ""
        if content.startswith(self._sent_content):
            out.content += content[len(self._sent_content) :]
        for i, call in enumerate(parsed.tool_calls):
            out.tool_calls.append(ToolDelta(i, call.id, call.name, ""))
            out.tool_calls.append(ToolDelta(i, arguments=call.arguments))
        self._held_calls = parsed.tool_calls

    def feed(self, text: str) -> ChoiceDelta:
        out = ChoiceDelta()
        if self.reasoning is not None:
            s = self.reasoning.feed(text)
            out.reasoning, text = s.reasoning, s.content
        return self._answer(out, text, end=False)

    def finish(self, cut: bool = False) -> ChoiceDelta:
        """The choice's end; `cut`: it ended at its length limit (finish "length")."""
        out = ChoiceDelta()
        text = ""
        if self.reasoning is not None:
            s = self.reasoning.finish()
            out.reasoning, text = s.reasoning, s.content
        return self._answer(out, text, end=True, cut=cut)

    def step(self, text: str, finished: bool, cut: bool = False) -> ChoiceDelta | None:
        """One engine delta: `feed` its text, and `finish` when it is the choice's last
        (`cut`: at its length limit); None when neither applies."""
        piece = self.feed(text) if text else None
        if finished:
            end = self.finish(cut)
            if piece is None:
                return end
            piece.reasoning += end.reasoning
            piece.content += end.content
            piece.tool_calls += end.tool_calls
        return piece


def parse_choice(dialect: ChatDialect, text: str, cut: bool = False) -> ChoiceResult:
    """A whole choice: reasoning split off, then the calls (a malformed one: all content).
    `cut`: the choice ended at its length limit; a call it cut short is dropped and the
    complete ones are still calls (`parse_tool_calls`)."""
    reasoning = None
    s = dialect.reasoning_stream()
    if s is not None:
        a, b = s.feed(text), s.finish()
        reasoning = (a.reasoning + b.reasoning) or None
        text = a.content + b.content
    if dialect.tool_parser is None:
        return ChoiceResult(reasoning, text, [])
    parsed = parse_tool_calls(text, dialect.tool_parser, dialect.tool_names, cut)
    calls = dialect.allowed_calls(parsed.tool_calls)
    return ChoiceResult(reasoning, parsed.content, calls, parsed.dropped)
