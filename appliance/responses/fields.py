"""The field policy of `POST /v1/responses`: every request field, what this server does with
it, in one table.

Each field is HONORED (it does what OpenAI documents, within the limits its note states),
IGNORED (accepted, echoed where the Response has it, and changes nothing here: the note
says why), or REFUSED (a 400 naming the field, unless its value is the harmless default:
null, false or empty, which is dropped). `apply_policy` enforces the REFUSED rows on the raw
body before validation; the request model (`protocol.ResponsesRequest`) declares exactly
the HONORED and IGNORED rows (a test checks both that and that every field of the
installed openai SDK's `responses.create` is a row), and docs/responses.md lists the same
rows. Values a HONORED field cannot take (a built-in tool, `truncation: auto`) are refused
where the field is read, naming the field's path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appliance.responses.errors import ResponsesError

HONORED, IGNORED, REFUSED = "honored", "ignored", "refused"


def _unset(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {}


@dataclass(frozen=True)
class Policy:
    kind: str  # HONORED | IGNORED | REFUSED
    note: str  # what this server does with it (docs/responses.md says the same)
    # REFUSED: values that mean "not used" and are dropped instead of refused.
    harmless: Callable[[Any], bool] = _unset


FIELDS: dict[str, Policy] = {
    # ---- honored -----------------------------------------------------------------------
    "input": Policy(HONORED, "a string, or message / function_call / function_call_output / "
                    "reasoning items; text content parts only"),
    "instructions": Policy(HONORED, "a system message first; not carried over by "
                           "previous_response_id"),
    "model": Policy(HONORED, "the served model or a loaded LoRA adapter's name"),
    "max_output_tokens": Policy(HONORED, "reasoning tokens included; null: up to the context"),
    "temperature": Policy(HONORED, "0 to 2; default 1"),
    "top_p": Policy(HONORED, "default 1"),
    "tools": Policy(HONORED, "function tools only; built-in tools (web search, file search, "
                    "computer use, MCP, ...) are refused naming tools.N.type"),
    "tool_choice": Policy(HONORED, "none, auto, required or {type: function, name}; required "
                          "and a named function are enforced by the grammar engine"),
    "parallel_tool_calls": Policy(HONORED, "false: at most one call when a call is forced"),
    "text": Policy(HONORED, "format text, json_object or json_schema (structured outputs); "
                   "verbosity is ignored"),
    "reasoning": Policy(HONORED, "the server's reasoning parser makes reasoning items; effort "
                        "none turns thinking off in the template; other efforts, summary, "
                        "generate_summary, context and mode change nothing"),
    "metadata": Policy(HONORED, "up to 16 string pairs, stored and echoed"),
    "user": Policy(HONORED, "echoed; nothing else"),
    "stream": Policy(HONORED, "server-sent events as OpenAI documents them"),
    "stream_options": Policy(HONORED, "only with stream; include_obfuscation is ignored (no "
                             "obfuscation field is sent)"),
    "store": Policy(HONORED, "default true: kept in the store for previous_response_id, GET, "
                    "DELETE and input_items"),
    "previous_response_id": Policy(HONORED, "its input and output items come first; 404 when "
                                   "unknown, expired, deleted or another owner's"),
    "include": Policy(HONORED, "message.output_text.logprobs and reasoning.encrypted_content "
                      "are served; the built-in tool and image values include nothing"),
    "top_logprobs": Policy(HONORED, "0 to 20 alternatives per token, with "
                           "include message.output_text.logprobs"),
    "truncation": Policy(HONORED, "disabled (the default: an input over the context is a "
                         "400); auto is refused"),
    # ---- ignored -----------------------------------------------------------------------
    "safety_identifier": Policy(IGNORED, "echoed; no abuse detection runs here"),
    "prompt_cache_key": Policy(IGNORED, "echoed; prefix caching is automatic (cache_salt "
                               "isolates)"),
    "prompt_cache_retention": Policy(IGNORED, "cached blocks live until evicted"),
    "prompt_cache_options": Policy(IGNORED, "cached blocks live until evicted; prewarm: true "
                                   "is refused"),
    "service_tier": Policy(IGNORED, "one tier; responses say default"),
    "max_tool_calls": Policy(IGNORED, "counts built-in tool calls, which are never made here"),
    "image": Policy(IGNORED, "image inputs are refused anyway"),
    "access_programs": Policy(IGNORED, "OpenAI account programs"),
    # ---- refused -----------------------------------------------------------------------
    "background": Policy(REFUSED, "background mode is not served (true is refused)"),
    "background_options": Policy(REFUSED, "background mode is not served"),
    "conversation": Policy(REFUSED, "the Conversations API is not served; use "
                           "previous_response_id"),
    "prompt": Policy(REFUSED, "stored prompt templates are not served"),
    "context_management": Policy(REFUSED, "server-side compaction is not served"),
    "moderation": Policy(REFUSED, "no moderation model runs here"),
    # ---- vLLM's extensions ---------------------------------------------------------------
    "cache_salt": Policy(HONORED, "vLLM's prefix-cache isolation, as in chat"),
    "priority": Policy(HONORED, "vLLM's: lower runs first under scheduler.policy: priority"),
    "seed": Policy(HONORED, "vLLM's per-request seed"),
    "top_k": Policy(HONORED, "vLLM's; -1 or 0: off"),
    "min_p": Policy(HONORED, "vLLM's"),
    "repetition_penalty": Policy(HONORED, "vLLM's"),
    "stop": Policy(HONORED, "vLLM's stop strings"),
    "ignore_eos": Policy(HONORED, "vLLM's"),
    "min_tokens": Policy(HONORED, "vLLM's"),
}  # fmt: skip


def apply_policy(data: dict[str, Any]) -> None:
    """Refuses (400 naming the field) a REFUSED field with a meaningful value; drops it when
    its value is harmless. Unknown fields are left to the request model (a 400 naming them)."""
    for name in [k for k in data if k in FIELDS and FIELDS[k].kind == REFUSED]:
        policy = FIELDS[name]
        if policy.harmless(data[name]):
            del data[name]
        else:
            raise ResponsesError(
                f"'{name}' is not supported by this server: {policy.note}",
                name,
                "unsupported_parameter",
            )
