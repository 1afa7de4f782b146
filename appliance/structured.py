"""Structured outputs as clients send them: every spelling becomes one StructuredOutputsParams.

A client names a constraint in one of several places. HTTP: OpenAI's `response_format`,
vLLM's `structured_outputs` object, or the legacy `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`. Native gRPC: the `structured_outputs` oneof of
`SamplingParams`. KServe: `sampling_parameters` keys as Triton's vLLM backend names them.
Each frontend lists what the request set as `Given(field, kind, value)`, `field` being the
path the client wrote; `build` checks the values (any JSON type can arrive: KServe's JSON is
untyped), refuses more than one constraint, and makes the engine's params. Its errors are
`SamplingParamsError`s naming the client's field, and `client_field` maps the engine's later
errors (`structured_outputs.<kind>`, a grammar that fails to compile) back to that field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import SamplingParamsError, StructuredOutputsParams

# The kinds of StructuredOutputsParams, as vLLM names them.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Given:
    """A constraint as the request set it: where, which kind, the raw value."""

    field: str
    kind: str
    value: Any


@dataclass(frozen=True)
class Constraint:
    """The engine's params and the request field they came from (for error messages)."""

    params: StructuredOutputsParams
    field: str


def build(given: Sequence[Given]) -> Constraint | None:
    """The one constraint the request set, or None; SamplingParamsError naming the field.

    `json_object: false` sets nothing (as in vLLM)."""
    for g in given:
        _check(g)
    given = [g for g in given if not (g.kind == "json_object" and g.value is False)]
    if not given:
        return None
    if len(given) > 1:
        raise SamplingParamsError(
            "only one structured output constraint may be set, got "
            + ", ".join(g.field for g in given),
            given[1].field,
        )
    g = given[0]
    value = _schema(g) if g.kind == "json" else g.value
    try:
        params = StructuredOutputsParams(**{g.kind: value})
    except SamplingParamsError as e:
        raise SamplingParamsError(e.reason, g.field) from None
    return Constraint(params, g.field)


def is_engine_param(param: str | None) -> bool:
    """Whether an engine error's param is about the constraint (`structured_outputs[.<kind>]`)."""
    return param is not None and param.split(".")[0] == "structured_outputs"


def client_field(param: str | None, constraint: Constraint | None) -> str | None:
    """The request's field for an engine error about the constraint; other params as they are."""
    if constraint is not None and is_engine_param(param):
        return constraint.field
    return param


def from_object(obj: Any, path: str, ignore: frozenset[str] = frozenset()) -> list[Given]:
    """The constraints in a vLLM `structured_outputs` object ({"json": ...}, {"regex": ...});
    `path` is where the object sits, `ignore` keys accepted and dropped."""
    if not isinstance(obj, dict):
        raise SamplingParamsError(f"must be an object with one of {', '.join(KINDS)}", path)
    out = []
    for key, value in obj.items():
        if key in ignore:
            continue
        if key not in KINDS:
            raise SamplingParamsError(
                f"unknown key {key!r:.40}; expected one of {', '.join(KINDS)}", path
            )
        if value is not None:
            out.append(Given(f"{path}.{key}", key, value))
    if not out and not obj.keys() - ignore:
        raise SamplingParamsError(f"must set one of {', '.join(KINDS)}", path)
    return out


def _check(g: Given) -> None:
    """Types and emptiness; what the grammar engine refuses is its to say (at admission)."""
    v = g.value
    if g.kind == "json":
        ok, want = isinstance(v, dict | str), "a JSON Schema (an object, or its JSON text)"
    elif g.kind == "json_object":
        ok, want = isinstance(v, bool), "a boolean"
    elif g.kind == "choice":
        ok = isinstance(v, list | tuple) and bool(v) and all(isinstance(c, str) and c for c in v)
        want = "a non-empty list of non-empty strings"
    else:  # regex, grammar
        ok, want = isinstance(v, str) and bool(v), "a non-empty string"
    if not ok:
        raise SamplingParamsError(f"must be {want}, got {v!r:.80}", g.field)


def _schema(g: Given) -> dict:
    """A JSON Schema as a dict: given as text, it must parse to an object."""
    schema = g.value
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise SamplingParamsError(f"not valid JSON: {e}", g.field) from None
    if not isinstance(schema, dict):
        raise SamplingParamsError(
            f"must be a JSON Schema object, got {type(schema).__name__}", g.field
        )
    return schema
