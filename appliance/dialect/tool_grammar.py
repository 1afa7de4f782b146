"""The grammar that makes `tool_choice: "required"` or a named function a guarantee.

A llguidance Lark grammar (`StructuredOutputsParams.grammar`) in the tool parser's own
output format, with each function's JSON schema embedded (`%json`), so the model can only
write calls the parser reads and whose arguments validate against the schema. `name` comes
first in each call object, so the stream sends it before the arguments.
"""

from __future__ import annotations

import json

from engine.sampling_params import StructuredOutputsParams


def _call_schema(tools: list[dict], args_key: str) -> dict:
    """One call object: `{"name": <one of the tools>, <args_key>: <its parameters>}`."""
    variants = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    # Compact JSON, as the engine's json constraint (engine/worker/structured/compiler.py):
    # no run of blanks and newlines between tokens up to max_tokens.
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def tool_call_grammar(tools: list[dict], parser: str, parallel: bool = True) -> str:
    """Lark text for one call (or, with `parallel`, one or more) of the given tools."""
    args_key = "parameters" if parser == "llama3" else "arguments"
    schema = json.dumps(_call_schema(tools, args_key), ensure_ascii=False)
    if parser == "hermes":
        more = ' ("\\n" call)*' if parallel else ""
        return (
            f"start: call{more}\n"
            f'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {schema}\n"
        )
    if parser == "llama3":
        more = ' ("; " body)*' if parallel else ""
        return f"start: body{more}\nbody: %json {schema}\n"
    if parser == "mistral":
        more = ' (", " body)*' if parallel else ""
        return f'start: "[TOOL_CALLS][" body{more} "]"\nbody: %json {schema}\n'
    raise ValueError(f"unknown tool parser {parser!r}")


def tool_call_constraint(
    tools: list[dict], parser: str, parallel: bool, start_after: str | None
) -> StructuredOutputsParams:
    """The constraint for `required` (all `tools`) or a named function (`tools` = [it])."""
    return StructuredOutputsParams(
        grammar=tool_call_grammar(tools, parser, parallel), start_after=start_after
    )
