"""Hypothesis drives arbitrary constraints through the engine: a "stop" always validates.

The contract: a constrained request is refused up front naming `structured_outputs.<kind>`,
or each of its samples ends "stop" with text that satisfies the constraint (`re.fullmatch`,
`jsonschema`, membership), "length" with a prefix the grammar accepts, or "error" with an
error naming the field; never a "stop" that breaks the constraint. The strategies mix
ordinary constraints with the ones that push llguidance past its limits (repetition counts
in the hundreds of thousands, thousands of choices sharing a prefix, nested repetitions),
and the examples pinned below are the ones that ended "stop" outside their constraint.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.sampling_params import SamplingParamsError

MAX_TOKENS = 24

# ---- regexes in the syntax Python's re and llguidance's regex share ----------------------
_ATOMS = st.sampled_from(["a", "b", "x", "0", "[ab]", "[a-z]", "[0-9]", " ", "\\.", "-"])
_COUNTS = st.one_of(st.integers(0, 4), st.sampled_from([2000, 170000, 400000]))


def _repeat(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    def fmt(args: tuple[str, str, int]) -> str:
        body, op, n = args
        group = f"({body})"
        return {"*": f"{group}*", "+": f"{group}+", "?": f"{group}?"}.get(op, f"{group}{{{n}}}")

    return st.tuples(inner, st.sampled_from(["*", "+", "?", "{n}"]), _COUNTS).map(fmt)


REGEX = st.recursive(
    _ATOMS,
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
        _repeat(inner),
    ),
    max_leaves=6,
)

# ---- JSON schemas --------------------------------------------------------------------------
_SCALARS = st.one_of(
    st.just({"type": "integer"}),
    st.just({"type": "boolean"}),
    st.builds(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 9}, st.integers(-5, 5)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda rx: {"type": "string", "pattern": f"^{rx}$"}, REGEX),
    st.lists(
        st.sampled_from(["red", "green", "blue", "x"]), min_size=1, max_size=3, unique=True
    ).map(lambda e: {"enum": e}),  # fmt: skip
)
SCHEMA = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.dictionaries(
            st.sampled_from(["reasoning", "answer", "a", "b"]), inner, min_size=1, max_size=3
        ).map(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": list(props),
                "additionalProperties": False,
            }
        ),  # fmt: skip
        st.builds(
            lambda it, n: {"type": "array", "items": it, "maxItems": n}, inner, st.integers(0, 3)
        ),  # fmt: skip
    ),
    max_leaves=5,
)

CHOICES = st.one_of(
    st.lists(st.text("abxyz", min_size=1, max_size=6), min_size=1, max_size=5, unique=True),
    st.integers(1990, 2010).map(lambda n: [f"option{i:04d}" for i in range(n)]),
)

SPECS = st.one_of(
    REGEX.map(lambda rx: StructuredOutputsParams(regex=rx)),
    SCHEMA.map(lambda s: StructuredOutputsParams(json=s)),
    CHOICES.map(lambda c: StructuredOutputsParams(choice=c)),
)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=256,
               block_size=16, max_num_seqs=16)  # fmt: skip


def _validates(spec: StructuredOutputsParams, text: str) -> bool:
    if spec.json is not None:
        try:
            jsonschema.validate(json.loads(text), spec.json)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if spec.regex is not None:
        return re.fullmatch(spec.regex, text) is not None
    return text in (spec.choice or ())


def _accepts_prefix(llm: LLM, spec: StructuredOutputsParams, token_ids: list[int]) -> bool:
    m = llm.engine.grammars.compile(spec).new_matcher()
    return m.consume_tokens(token_ids) and not m.is_error()


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(spec=SPECS, seed=st.integers(0, 2**31))
@example(spec=StructuredOutputsParams(regex="a{400000}"), seed=0)
@example(spec=StructuredOutputsParams(choice=[f"option{i:04d}" for i in range(2000)]), seed=0)
@example(spec=StructuredOutputsParams(json={"type": "object", "properties": {"x": {
    "type": "string", "pattern": "^a{400000}$"}}, "required": ["x"]}), seed=0)  # fmt: skip
def test_every_stop_of_a_constrained_request_validates(llm, spec, seed) -> None:
    params = SamplingParams(temperature=1.0, n=2, seed=seed, max_tokens=MAX_TOKENS,
                            structured_outputs=spec)  # fmt: skip
    try:
        (out,) = llm.generate(["Hello"], params, use_tqdm=False)
    except SamplingParamsError as e:  # refused up front: naming the field
        assert e.param == f"structured_outputs.{spec.kind}", e.param
        return
    assert out.error is None, out.error
    for c in out.outputs:
        if c.finish_reason == "stop":
            assert _validates(spec, c.text), (spec, c.text)
        elif c.finish_reason == "length":
            assert len(c.token_ids) == MAX_TOKENS and _accepts_prefix(llm, spec, c.token_ids)
        else:
            assert c.finish_reason == "error", c.finish_reason
            assert c.error.param == f"structured_outputs.{spec.kind}", c.error
    kv = llm.engine.kv_manager
    assert kv.stats().num_free_blocks == kv.num_blocks
