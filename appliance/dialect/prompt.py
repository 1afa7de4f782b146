"""The prompt of a chat-shaped request: OpenAI-shaped message dicts through the model's chat
template, with the request's tools (or the fallback system prompt).

One function for every frontend that renders a conversation (chat completions, the
Responses API), so the same checks refuse the same things with the same codes. Errors are
`DialectError`s whose `param` is relative to the conversation (`messages`, or a key of
`chat_template_kwargs`); the caller names its own field.
"""

from __future__ import annotations

from appliance.dialect.chat_output import DialectError
from appliance.dialect.tools_prompt import template_inputs

# chat_template_kwargs the server sets itself, or that would change what rendering returns.
# `chat_template` is refused as well: a template sent by the client is code the server runs
# (Jinja's sandbox stops escapes, not `{% for %}` loops nested until the event loop stalls).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template", "tokenize", "return_dict", "return_tensors", "tokenizer_kwargs",
        "return_assistant_tokens_mask", "padding", "truncation", "max_length",
        "add_generation_prompt", "continue_final_message", "conversation", "messages", "tools",
    }
)  # fmt: skip


def render_messages(
    tok: object,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Prompt token ids of `messages` (OpenAI-shaped dicts) under `tok`'s chat template.

    `tools` reach the template as `tools=` when it handles them, else through the fallback
    system prompt (appliance/dialect/tools_prompt.py). A template that raises is a
    DialectError (`messages`, code invalid_messages)."""
    if not tok.has_chat_template():  # type: ignore[attr-defined]
        raise DialectError(
            "this model has no chat template; use /v1/completions", "messages", "no_chat_template"
        )
    if add_generation_prompt and continue_final_message:
        raise DialectError(
            "add_generation_prompt and continue_final_message cannot both be true",
            "continue_final_message",
        )
    kw = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kw))
    if reserved:
        raise DialectError(
            f"chat_template_kwargs may not set {reserved[0]!r}",
            f"chat_template_kwargs.{reserved[0]}",
        )
    if continue_final_message:
        kw["continue_final_message"] = True
    dicts, tool_kw = template_inputs(messages, tools, tok)
    kw.update(tool_kw)
    try:
        return list(
            tok.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, **kw)  # type: ignore[attr-defined]
        )
    except Exception as e:  # jinja raise_exception(), bad kwargs, ...
        raise DialectError(f"chat template failed: {e}", "messages", "invalid_messages") from None
