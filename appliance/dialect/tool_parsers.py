"""Tool calls in model output, per model family, parsed whole or as a stream.

Every family writes a call as a JSON object with a name and an arguments object; they differ
in what surrounds it:

| parser  | output                                                     | arguments key |
|---------|------------------------------------------------------------|---------------|
| hermes  | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen, Hermes, the fallback prompt) | arguments |
| llama3  | `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`, several joined by `;`) | parameters |
| mistral | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`      | arguments |

One scanner (`ToolCallStream`) serves both uses, so a streamed and a whole answer cannot
disagree: it walks the text once, sends plain text as content up to where a call may begin,
and for each call its name as soon as `{"name": "...", "arguments": ` has arrived, then the
arguments' JSON text as it grows. A call written in another key order is sent whole once its
object is complete. `parse_tool_calls` runs the scanner over the whole text and checks the
result: any call whose arguments are not a JSON object, or whose name is not a declared
tool, turns the whole answer back into plain content (never an error).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3", "mistral")

_DECODER = json.JSONDecoder()
_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class _Format:
    start: str  # text that opens the tool-call section ("" for llama3: a leading `{`)
    between: re.Pattern  # what may separate calls (and close the section)
    start_only_at_beginning: bool = False
    markers: tuple[str, ...] = ()  # the separators' tags: wait while one is half-written


_FORMATS = {
    "hermes": _Format(
        "<tool_call>",
        re.compile(r"\s*(?:</tool_call>\s*)?(?:<tool_call>\s*)?"),
        markers=("</tool_call>", "<tool_call>"),
    ),
    "llama3": _Format("", re.compile(r"\s*;?\s*"), start_only_at_beginning=True),
    "mistral": _Format("[TOOL_CALLS]", re.compile(r"\s*[\[,\]]?\s*")),
}


def new_call_id() -> str:
    """OpenAI's shape: `call_` and 24 random alphanumerics."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text of the arguments object


@dataclass
class ToolDelta:
    """One piece of a streamed call: the first carries id and name, later ones arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolDelta] = field(default_factory=list)


def _json_end(text: str, start: int) -> int | None:
    """The end of the JSON value starting at `start` (an object, array, string or scalar), or
    None while it is incomplete. Brackets and strings are tracked; the syntax inside is not
    checked here (`parse_tool_calls` checks the finished arguments)."""
    depth = 0
    in_str = esc = False
    i = start
    if i < len(text) and text[i] not in '{["':
        m = re.compile(r"[^,}\]\s]*").match(text, i)
        end = m.end() if m else i
        return end if end < len(text) else None
    while i < len(text):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Scans one choice's text as it grows; `feed` returns what can be sent now."""

    def __init__(self, parser: str):
        if parser not in _FORMATS:
            raise ValueError(f"unknown tool parser {parser!r}")
        self.fmt = _FORMATS[parser]
        self.text = ""
        self.pos = 0  # everything before is sent
        self.in_calls = False
        self.args_start: int | None = None  # inside a call's arguments, sent up to self.pos
        self.calls: list[ToolCall] = []
        self.content = ""
        self.dropped = 0  # calls cut short by the length limit (`finish(cut=True)`)

    def feed(self, piece: str) -> ParsedDelta:
        self.text += piece
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def finish(self, cut: bool = False) -> ParsedDelta:
        """The end of the text: what is left unsent is content (a malformed call included).

        `cut`: the text ended at its length limit (finish "length"), so a call still open
        was cut short, not malformed: it is dropped (`dropped`), and what was left of it
        is neither arguments nor content; the complete calls before it stand."""
        out = ParsedDelta()
        rest = self.text[self.pos :]
        if cut and self.in_calls:
            if self.args_start is not None:
                self.calls.pop()
                self.dropped += 1
                self.args_start = None
            elif "{" in rest:
                self.dropped += 1  # a call cut before its arguments began (else a separator)
        elif self.args_start is not None:  # cut mid-arguments (max_tokens): send what came
            if rest:
                self._args(out, rest)
        elif not self.in_calls or self.fmt.between.fullmatch(rest) is None:
            self._content(out, rest)
        self.pos = len(self.text)
        return out

    # ---- the scanner -------------------------------------------------------------------
    def _content(self, out: ParsedDelta, text: str) -> None:
        if text:
            out.content += text
            self.content += text

    def _args(self, out: ParsedDelta, text: str) -> None:
        self.calls[-1].arguments += text
        if out.tool_calls and out.tool_calls[-1].index == len(self.calls) - 1:
            out.tool_calls[-1].arguments += text
        else:
            out.tool_calls.append(ToolDelta(len(self.calls) - 1, arguments=text))

    def _new_call(self, out: ParsedDelta, name: str, arguments: str) -> None:
        call = ToolCall(new_call_id(), name, arguments)
        self.calls.append(call)
        out.tool_calls.append(ToolDelta(len(self.calls) - 1, call.id, name, arguments))

    def _step(self, out: ParsedDelta) -> bool:
        """Advances once; False when it needs more text."""
        text, fmt = self.text, self.fmt
        if self.args_start is not None:
            if self.pos == self.args_start:  # skip blanks before the arguments' value
                while self.pos < len(text) and text[self.pos].isspace():
                    self.pos += 1
                self.args_start = self.pos
                if self.pos == len(text):
                    return False
            end = _json_end(text, self.args_start)
            if end is None:  # send the arguments so far
                if len(text) > self.pos:
                    self._args(out, text[self.pos :])
                    self.pos = len(text)
                return False
            m = re.compile(r"\s*\}").match(text, end)
            if m is None:
                if len(text) > end and text[end:].strip():
                    self._args(out, text[self.pos : end])  # a malformed close: let
                    self.pos = end  # parse_tool_calls judge
                    self.args_start = None
                    self.in_calls = False
                    return True
                if end > self.pos:
                    self._args(out, text[self.pos : end])
                    self.pos = end
                return False
            if end > self.pos:
                self._args(out, text[self.pos : end])
            self.pos, self.args_start = m.end(), None
            return True
        if not self.in_calls:
            return self._find_start(out)
        sep = fmt.between.match(text, self.pos)
        at = sep.end() if sep else self.pos
        if at >= len(text) or any(m.startswith(text[at:]) for m in fmt.markers):
            return False
        if text[at] != "{":
            self.in_calls, self.pos = False, at  # not a call: the rest is content
            return True
        header = _HEADER.match(text, at)
        if header is not None:
            name = json.loads(header.group(1))
            self._new_call(out, name, "")
            self.pos = self.args_start = header.end()
            return True
        end = _json_end(text, at)
        if end is None:
            return False  # wait: the header may still come, or the object complete
        try:
            obj = json.loads(text[at:end])
        except ValueError:
            obj = None
        args = (obj or {}).get("arguments", (obj or {}).get("parameters"))
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and args is not None:
            self._new_call(out, obj["name"], json.dumps(args, ensure_ascii=False))
            self.pos = end
            return True
        self.in_calls = False
        return True

    def _find_start(self, out: ParsedDelta) -> bool:
        text, fmt = self.text, self.fmt
        if fmt.start_only_at_beginning:
            if self.pos == 0:
                lead = len(text) - len(text.lstrip())
                body = text[lead:]
                if not body or "<|python_tag|>".startswith(body):
                    return False
                if body.startswith("<|python_tag|>"):
                    self.pos, self.in_calls = lead + len("<|python_tag|>"), True
                    return True
                if body.startswith("{"):
                    self.pos, self.in_calls = lead, True
                    return True
            self._content(out, text[self.pos :])
            self.pos = len(text)
            return False
        i = text.find(fmt.start, self.pos)
        if i >= 0:
            self._content(out, text[self.pos : i])
            self.pos, self.in_calls = i + len(fmt.start), True
            return True
        keep = _partial_prefix(text[self.pos :], fmt.start)
        self._content(out, text[self.pos : len(text) - keep])
        self.pos = len(text) - keep
        return False


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]
    dropped: int = 0  # calls cut short by the length limit and left out


def parse_tool_calls(
    text: str, parser: str, tool_names: set[str] | None = None, cut: bool = False
) -> ParsedOutput:
    """A whole answer's content and tool calls; a malformed call leaves it all as content.

    `cut`: the answer ended at its length limit; the call it cut short is dropped
    (`ParsedOutput.dropped`) and the complete ones before it are returned as calls, not
    as the raw markup in content (issue 28, E15)."""
    s = ToolCallStream(parser)
    s.feed(text)
    s.finish(cut)
    if not s.calls:
        if s.dropped:  # only a cut call: what came before it, never the call's markup
            return ParsedOutput(s.content or None, [], s.dropped)
        return ParsedOutput(text, [])
    for c in s.calls:
        try:
            args = json.loads(c.arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict) or (tool_names is not None and c.name not in tool_names):
            return ParsedOutput(text, [])
    content = s.content if s.content.strip() or not s.calls else None
    return ParsedOutput(content, s.calls, s.dropped)
