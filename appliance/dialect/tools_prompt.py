"""Tools and tool history for the chat template, with a fallback for templates without tools.

A template that handles tools (its source mentions `tools`) gets them as `tools=` and the
history as OpenAI sent it, with each call's `arguments` decoded to an object (what Qwen's,
Llama's and Mistral's templates expect, as vLLM passes them). A template that has none (the
default SmolLM2's) would drop them silently, so the fallback writes them into the system
prompt instead, in the Hermes format that the `hermes` parser reads back:

    You can call these tools. ... <tools>{...}</tools>
    To call one, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>

and renders history through plain roles: an assistant's calls as that same text, a `tool`
message as a user turn wrapped in `<tool_response>`.
"""

from __future__ import annotations

import json

FALLBACK_INTRO = (
    "You can call the following tools. Each is described by a JSON schema inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, answer with one line per call, each of the form\n"
    '<tool_call>{{"name": <tool name>, "arguments": <arguments object>}}</tool_call>\n'
    "and nothing else. When no tool is needed, answer normally."
)


def template_handles_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def template_text(tok: object) -> str | None:
    """The chat template's source (None when unknown, as for test tokenizers)."""
    t = getattr(getattr(tok, "hf", None), "chat_template", None)
    if isinstance(t, dict):  # named templates: any of them may handle tools
        return "\n".join(str(v) for v in t.values())
    return t if isinstance(t, str) else None


def template_inputs(
    messages: list[dict], tools: list[dict] | None, tok: object
) -> tuple[list[dict], dict]:
    """(messages, extra template kwargs) for `tok`'s chat template: `tools=` when it handles
    them, else the fallback system prompt (`prepare_messages`)."""
    msgs, native_tools = prepare_messages(
        messages, tools, template_handles_tools(template_text(tok))
    )
    return msgs, ({"tools": native_tools} if native_tools else {})


def _decoded_calls(calls: list[dict]) -> list[dict]:
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass  # left as the client sent it
        out.append({**c, "function": fn})
    return out


def _call_text(call: dict) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


def prepare_messages(
    messages: list[dict], tools: list[dict] | None, native: bool
) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools=) for the template: native when it handles tools, else the fallback."""
    if native:
        msgs = [
            {**m, "tool_calls": _decoded_calls(m["tool_calls"])} if m.get("tool_calls") else m
            for m in messages
        ]
        return msgs, tools
    msgs = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = f"{m['content']}\n{text}" if m.get("content") else text
            msgs.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            msgs.append(
                {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
        else:
            msgs.append({k: v for k, v in m.items() if k != "tool_calls"})
    if tools:
        described = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        intro = FALLBACK_INTRO.format(tools=described)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{intro}"}
        else:
            msgs.insert(0, {"role": "system", "content": intro})
    return msgs, None


def parser_for_template(template: str | None) -> str:
    """`server.tool_parser: auto`: the family the template writes, else hermes (the
    fallback prompt's format)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("parameters" in t and "<|eot_id|>" in t):
        return "llama3"
    return "hermes"
