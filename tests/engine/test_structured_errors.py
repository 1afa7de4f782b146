"""Structured outputs keep their promise or fail loudly (offline API, tiny random model).

A constraint the grammar engine cannot honor must never end as a clean "stop" holding text
outside it. What llguidance can tell up front (parser and lexer limits on the forced
prefix, an empty language, a `$ref` cycle) is refused when the request is prepared, naming
the field; what it can only find while generating (a limit hit after the model chose a
branch) ends that sample with `finish_reason: "error"` and an error naming the cause, while
the request's other samples carry on (an `n > 1` request's choices are independent).
"""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.sampling_params import SamplingParamsError

# `start: a60`, a60 -> a59 a59 -> ... -> "a": one sentence, 2**60 a's long.
DOUBLING = "start: a60\n" + "".join(f"a{i + 1}: a{i} a{i}\n" for i in range(60)) + 'a0: "a"\n'
HUGE_PATTERN = {
    "type": "object",
    "properties": {"x": {"type": "string", "pattern": "^a{400000}$"}},
    "required": ["x"],
}
# 2,001 alternatives after a shared prefix: more than llguidance's 2,000 items in an Earley
# row, hit only once the model took the "x" branch (so nothing can refuse it up front).
LATE_LIMIT = 'start: "ok" | "x" tail\ntail: ' + " | ".join(f'"p{i:04d}"' for i in range(2001))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=512,
               block_size=16, max_num_seqs=32)  # fmt: skip


def _greedy(spec: StructuredOutputsParams, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 24)
    return SamplingParams(temperature=0.0, structured_outputs=spec, **kw)


@pytest.mark.parametrize(
    "spec, field",
    [
        (StructuredOutputsParams(regex="a{400000}"), "regex"),
        (StructuredOutputsParams(json=HUGE_PATTERN), "json"),
        (StructuredOutputsParams(grammar=DOUBLING), "grammar"),
        (
            StructuredOutputsParams(
                json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
            ),
            "json",
        ),
        (StructuredOutputsParams(json={"$ref": "#"}), "json"),
        (StructuredOutputsParams(grammar='start: "a" start\n'), "grammar"),
    ],
    ids=["regex-limit", "pattern-limit", "lark-2^60", "ref-cycle", "self-ref", "empty-language"],
)
def test_a_grammar_that_cannot_be_honored_is_refused_naming_its_field(llm, spec, field):
    with pytest.raises(SamplingParamsError) as e:
        llm.engine.prepare_request("bad", "Hello", _greedy(spec))
    assert e.value.param == f"structured_outputs.{field}"
    assert len(str(e.value)) < 700  # the grammar engine's state dump is not echoed


def test_two_thousand_choices_are_honored(llm):
    choices = [f"option{i:04d}" for i in range(2000)]
    (out,) = llm.generate(["Pick one:"], _greedy(StructuredOutputsParams(choice=choices)),
                          use_tqdm=False)  # fmt: skip
    c = out.outputs[0]
    assert (c.finish_reason, c.text in choices) == ("stop", True), c.text


def _x_id(llm: LLM) -> int:
    (x,) = llm.tokenizer.encode("x")
    return x


def test_a_matcher_error_while_generating_ends_the_sample_with_error_not_stop(llm):
    """The model is steered into the branch whose limit llguidance hits late."""
    params = _greedy(StructuredOutputsParams(grammar=LATE_LIMIT), logit_bias={_x_id(llm): 100.0})
    (out,) = llm.generate(["Hello"], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "error", (c.finish_reason, c.text)
    assert c.error is not None and c.error.param == "structured_outputs.grammar"
    assert "grammar" in c.error.message and "2000" in c.error.message, c.error.message
    assert c.text == ""  # "x", the token whose consumption hit the limit, is not output
    assert out.error is None  # the request as a whole did not fail
    assert llm.engine.kv_manager.stats().num_free_blocks == llm.engine.kv_manager.num_blocks


def test_one_samples_grammar_error_leaves_its_siblings_to_finish(llm):
    """n = 4: the failed choice ends with "error"; the other three run to their own end."""
    choices = ["alpha", "beta", "gamma"]
    spec = StructuredOutputsParams(choice=choices)
    engine = llm.engine
    real = engine.runner.execute
    victim = "#2"

    def failing_one(so):  # the runner reports one sample's grammar as broken, once
        out = real(so)
        for i, rid in enumerate(list(out.req_ids)):
            if rid.endswith(victim) and rid not in out.failed:
                out.req_ids.pop(i)
                out.sampled_token_ids.pop(i)
                out.failed[rid] = "structured_outputs.choice: the grammar engine stopped: test"
                engine.runner.execute = real
                break
        return out

    engine.runner.execute = failing_one
    try:
        (out,) = llm.generate(["Hello"], SamplingParams(temperature=1.0, n=4, seed=3,
                              max_tokens=16, structured_outputs=spec), use_tqdm=False)  # fmt: skip
    finally:
        engine.runner.execute = real
    reasons = [c.finish_reason for c in out.outputs]
    assert reasons == ["stop", "stop", "error", "stop"], (reasons, out.error)
    assert out.outputs[2].error is not None
    assert all(c.text in choices for i, c in enumerate(out.outputs) if i != 2)
    assert out.error is None
    assert engine.kv_manager.stats().num_free_blocks == engine.kv_manager.num_blocks


def test_the_refusal_message_names_the_cause(llm):
    with pytest.raises(SamplingParamsError) as e:
        llm.engine.prepare_request(
            "bad", "Hello", _greedy(StructuredOutputsParams(json={"$ref": "#"}))
        )
    assert "no text" in str(e.value) or "cycle" in str(e.value), str(e.value)
    json.dumps(str(e.value))  # plain text, nothing binary
