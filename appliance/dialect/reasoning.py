"""`<think>…</think>`: the reasoning section split from the answer, whole or as a stream.

Two styles, as vLLM's `--reasoning-parser`:
- `qwen3`: the answer reasons only when it starts with `<think>` (Qwen3 with thinking on;
  with `enable_thinking: false` its template closes an empty section in the prompt).
- `deepseek_r1`: the template opens `<think>` in the prompt, so the answer is reasoning from
  its first token until `</think>` (a leading `<think>` is dropped); an answer that never
  closes it is all reasoning.

Where the answer starts is read from the rendered prompt's end (`answer_start`), so the
parser and the output constraint agree: a prompt ending in an open `<think>` makes the
answer reasoning from its first token, whichever parser; one ending in a closed section
(thinking disabled by the template) makes it all content; otherwise each parser's rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.dialect.tool_parsers import _partial_prefix

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"


# Where an answer starts (`answer_start`): in its reasoning, in its content, or either,
# as its first token decides (qwen3: reasoning only when the answer opens with <think>).
AnswerStart = str  # "reasoning" | "content" | "either"


def answer_start(parser: str, prompt_tail: str) -> AnswerStart:
    """Where the model's first token stands, from the end of the rendered prompt (its last
    few tokens as text, special tokens kept)."""
    tail = prompt_tail.rstrip()
    if tail.endswith(THINK_START):
        return "reasoning"  # the template opened the section (deepseek_r1's do)
    if tail.endswith(THINK_END):
        return "content"  # the template closed an empty one: thinking is off
    return "reasoning" if parser == "deepseek_r1" else "either"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Splits one choice's text as it grows; `feed` returns what can be sent now."""

    def __init__(self, parser: str, start: AnswerStart | None = None):
        """`start`: where the answer starts (`answer_start`); None: the parser's own rule."""
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.parser = parser
        if start is None:
            start = "reasoning" if parser == "deepseek_r1" else "either"
        self.start = start
        self.buf = ""  # text not yet sent (a marker may be forming at its end)
        # start -> reasoning -> content; an answer known to be content starts there.
        self.state = "content" if start == "content" else "start"
        self.after_end = False  # just past </think>: its trailing newlines are dropped

    def feed(self, piece: str) -> Split:
        self.buf += piece
        out = Split()
        if self.state == "start":
            lead = self.buf.lstrip()
            if THINK_START.startswith(lead) and len(lead) < len(THINK_START):
                return out  # `<thi` may become `<think>`
            if lead.startswith(THINK_START):
                self.buf = lead[len(THINK_START) :]
                self.state = "reasoning"
            else:
                self.state = "reasoning" if self.start == "reasoning" else "content"
        if self.state == "reasoning":
            i = self.buf.find(THINK_END)
            if i < 0:
                keep = _partial_prefix(self.buf, THINK_END)
                out.reasoning, self.buf = (
                    self.buf[: len(self.buf) - keep],
                    self.buf[-keep:] if keep else "",
                )
                return out
            out.reasoning, self.buf = self.buf[:i], self.buf[i + len(THINK_END) :]
            self.state, self.after_end = "content", True
        if self.state == "content":
            if self.after_end:
                self.buf = self.buf.lstrip("\n")
                self.after_end = not self.buf
            out.content, self.buf = self.buf, ""
        return out

    def finish(self) -> Split:
        """The end of the text: a marker that never completed is plain text."""
        if self.state == "start":
            self.state = "content"
        rest, self.buf = self.buf, ""
        return Split(reasoning=rest) if self.state == "reasoning" else Split(content=rest)


def split_reasoning(
    text: str, parser: str, start: AnswerStart | None = None
) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    s = ReasoningStream(parser, start)
    a, b = s.feed(text), s.finish()
    reasoning = a.reasoning + b.reasoning
    return (reasoning if s.state != "content" or reasoning or THINK_END in text else None), (
        a.content + b.content
    )
