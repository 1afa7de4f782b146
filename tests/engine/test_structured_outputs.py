"""Structured outputs through the offline API on a tiny random model at temperature 1.

Validity corpus: for every schema, regex and choice of `tests.support.schemas`, 50 samples;
each that finished with "stop" validates (jsonschema / fullmatch / membership), each cut
by "length" is a prefix the grammar accepts, and at least 90 % stop. Then the regressions
the peers shipped: mixed batches, preemption, prefix-cache hits, n > 1, bad specs, and the
grammar-versus-min_tokens conflict.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.sampling_params import SamplingParamsError
from tests.support.schemas import CHOICES, JSON_SCHEMAS, REGEXES

PROMPTS = ["Hello", "The capital of France is", "Once upon a time", "A journey of", "Water"]
SAMPLES_PER_PROMPT = 10  # x 5 prompts = 50 samples per constraint
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(
        str(tiny_llama_dir), dtype="float32", max_model_len=512, num_kv_blocks=2048,
        block_size=16, max_num_seqs=128,
    )  # fmt: skip


def _params(spec: StructuredOutputsParams, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=1.0, structured_outputs=spec, **kw)


def _accepts_prefix(llm: LLM, spec: StructuredOutputsParams, token_ids: list[int]) -> bool:
    matcher = llm.engine.grammars.compile(spec).new_matcher()
    return matcher.consume_tokens(token_ids) and not matcher.is_error()


CORPUS = (
    [(f"json:{name}", StructuredOutputsParams(json=schema)) for name, schema in JSON_SCHEMAS]
    + [(f"regex:{name}", StructuredOutputsParams(regex=rx)) for name, rx in REGEXES]
    + [(f"choice:{name}", StructuredOutputsParams(choice=c)) for name, c in CHOICES]
)


def _valid(spec: StructuredOutputsParams, text: str) -> bool:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json, format_checker=None)
        return True
    if spec.regex is not None:
        return re.fullmatch(spec.regex, text) is not None
    return text in (spec.choice or ())


def test_corpus_outputs_validate_and_mostly_stop(llm):
    batch = [
        (name, spec, prompt)
        for name, spec in CORPUS
        for prompt in PROMPTS
    ]  # fmt: skip
    outs = llm.generate(
        [p for _, _, p in batch],
        [_params(spec, n=SAMPLES_PER_PROMPT, seed=i) for i, (_, spec, _) in enumerate(batch)],
        use_tqdm=False,
    )
    by_name: dict[str, list[str]] = {}
    for (name, spec, _), out in zip(batch, outs, strict=True):
        assert out.error is None, (name, out.error)
        for c in out.outputs:
            by_name.setdefault(name, []).append(c.finish_reason)
            if c.finish_reason == "stop":
                assert _valid(spec, c.text), (name, c.text)
            else:
                assert c.finish_reason == "length", (name, c.finish_reason)
                assert len(c.token_ids) == MAX_TOKENS
                assert _accepts_prefix(llm, spec, c.token_ids), (name, c.text)
    for name, reasons in by_name.items():
        assert len(reasons) == len(PROMPTS) * SAMPLES_PER_PROMPT
        assert reasons.count("stop") >= 0.9 * len(reasons), (name, reasons.count("stop"))


def test_json_whitespace_is_compact(llm):
    """No blanks or newlines between JSON tokens (bounded whitespace)."""
    spec = StructuredOutputsParams(json=JSON_SCHEMAS[1][1])
    (out,) = llm.generate(["Hello"], _params(spec, n=8, seed=3), use_tqdm=False)
    stopped = [c for c in out.outputs if c.finish_reason == "stop"]
    assert stopped
    for c in stopped:
        json.loads(c.text)
        # Outside strings nothing is blank (a number's own digits, `45.418820`, are its own).
        between = re.sub(r'"(?:[^"\\]|\\.)*"', '""', c.text)
        assert not re.search(r"\s", between), c.text


def test_max_tokens_cuts_with_length_and_an_accepted_prefix(llm):
    spec = StructuredOutputsParams(json=JSON_SCHEMAS[0][1])
    (out,) = llm.generate(["Hello"], _params(spec, n=4, max_tokens=3, seed=1), use_tqdm=False)
    for c in out.outputs:
        assert c.finish_reason == "length"
        assert _accepts_prefix(llm, spec, c.token_ids)


def test_json_object_gives_an_object(llm):
    spec = StructuredOutputsParams(json_object=True)
    (out,) = llm.generate(["Hello"], _params(spec, n=8, seed=5), use_tqdm=False)
    for c in out.outputs:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert _accepts_prefix(llm, spec, c.token_ids)


def test_mixed_batch_leaves_unconstrained_output_as_its_solo_run(llm):
    free = SamplingParams(temperature=1.0, max_tokens=24, seed=11, ignore_eos=True)
    (solo,) = llm.generate(["Once upon a time"], free, use_tqdm=False)
    spec = StructuredOutputsParams(json=JSON_SCHEMAS[1][1])
    outs = llm.generate(
        ["Hello", "Once upon a time", "Water"],
        [_params(spec, seed=1), free, _params(spec, seed=2)],
        use_tqdm=False,
    )
    assert outs[1].outputs[0].token_ids == solo.outputs[0].token_ids
    for out in (outs[0], outs[2]):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and _valid(spec, c.text)


def _run_seeded(llm: LLM, spec: StructuredOutputsParams) -> list[list[int]]:
    outs = llm.generate(
        PROMPTS,
        [_params(spec, seed=100 + i, max_tokens=48) for i in range(len(PROMPTS))],
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


def test_preemption_replays_the_matcher(llm, tiny_llama_dir):
    """A small KV pool preempts by recompute; the seeded outputs equal the unpreempted run
    and stay valid, so the replayed matcher picked up where it stopped."""
    spec = StructuredOutputsParams(json=JSON_SCHEMAS[1][1])
    roomy = _run_seeded(llm, spec)
    small = LLM(
        str(tiny_llama_dir), dtype="float32", max_model_len=64, num_kv_blocks=16, block_size=4
    )
    tight = _run_seeded(small, spec)
    assert small.engine.stats().num_preemptions > 0
    assert tight == roomy
    assert any(len(t) > 8 for t in tight)  # long enough to have been preempted mid-output


def test_prefix_cache_hits_keep_outputs_valid(llm):
    spec = StructuredOutputsParams(json=JSON_SCHEMAS[2][1])
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    hits0 = llm.engine.stats().prefix_cache_hits
    (first,) = llm.generate([prompt], _params(spec, seed=9), use_tqdm=False)
    (second,) = llm.generate([prompt], _params(spec, seed=9), use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits > hits0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].finish_reason == "stop"
    assert _valid(spec, second.outputs[0].text)


def test_forked_samples_each_follow_the_grammar(llm):
    """n > 1: samples after the first fork its prompt blocks; each has its own matcher."""
    spec = StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"])
    (out,) = llm.generate(["Hello"], _params(spec, n=16, seed=4), use_tqdm=False)
    texts = [c.text for c in out.outputs]
    assert all(t in spec.choice for t in texts)
    assert len(set(texts)) > 1


def test_grammar_and_min_tokens_conflict_fails_by_name(llm):
    """Once the grammar allows only EOS, min_tokens masking EOS leaves no token."""
    spec = StructuredOutputsParams(choice=["yes"])
    (out,) = llm.generate(["Hello"], _params(spec, min_tokens=20), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "error" and out.error is None  # the sample's own failure
    assert "structured_outputs grammar" in c.error.message and "min_tokens=20" in c.error.message
    assert c.error.param == "structured_outputs.choice"


@pytest.mark.parametrize(
    "spec, field",
    [
        (StructuredOutputsParams(json={"type": "object", "properties": 3}), "json"),
        (StructuredOutputsParams(json="{not json"), "json"),
        (StructuredOutputsParams(json=[1, 2]), "json"),
        (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "json"),
        (StructuredOutputsParams(regex="a(b"), "regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule\n"), "grammar"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(llm, spec, field):
    with pytest.raises(SamplingParamsError) as e:
        llm.engine.prepare_request("bad", "Hello", _params(spec))
    assert e.value.param == f"structured_outputs.{field}"


def test_empty_choice_is_refused():
    with pytest.raises(SamplingParamsError) as e:
        StructuredOutputsParams(choice=[])
    assert e.value.param == "structured_outputs.choice"
