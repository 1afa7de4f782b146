"""Hypothesis drives arbitrary sampling parameters through the real engine; it never crashes.

The contract under test: a request is either refused up front (`SamplingParamsError` from
the params, `InvalidRequestError` from `prepare_request`, which the frontends turn into a
400 / INVALID_ARGUMENT naming the field) or it runs to completion inside a batch with
other requests, producing token ids inside the vocabulary, no more than `max_tokens` of
them, only allowed tokens when `allowed_token_ids` is set, finite (or -inf) logprobs and a
stop/length finish. Any other exception, a step that raises, or a KV block still held
afterwards is a bug. Values deliberately include the edges the validators must catch (NaN,
infinities, subnormals, negative and 80-bit integers), not only the valid ranges.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, SamplingParamsError
from tests.support.offline import run_to_finals
from tests.support.served_stack import tiny_engine

MAX_MODEL_LEN = 48
MAX_STEPS = 200
VOCAB = 512  # the tiny tokenizer's; checked against the engine below


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Any]:
    eng = tiny_engine(tiny_llama_dir, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64,
                      block_size=4, max_num_seqs=8)  # fmt: skip
    assert eng.vocab_size == VOCAB
    yield eng


def _floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    """In-range values, the range's edges, and the values a validator must refuse."""
    return st.one_of(
        st.floats(lo, hi),
        st.sampled_from([lo, hi, 0.0, 1.0, 5e-324, 1e-30, -1e-30, math.nan, math.inf, -math.inf]),
        st.floats(allow_nan=True, allow_infinity=True),
    )


token_ids = st.integers(-2, VOCAB + 2)
params_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(0, 5),
        "temperature": _floats(0.0, 2.0),
        "top_p": _floats(0.0, 1.0),
        "top_k": st.one_of(st.integers(-3, 8), st.sampled_from([VOCAB - 1, VOCAB, 10**9])),
        "min_p": _floats(0.0, 1.0),
        "presence_penalty": _floats(-2.0, 2.0),
        "frequency_penalty": _floats(-2.0, 2.0),
        "repetition_penalty": _floats(0.0, 2.0),
        "seed": st.one_of(st.none(), st.integers(-(2**80), 2**80)),
        "stop": st.lists(st.text(alphabet="ab .\n\u00e9\u4e2d", max_size=3), max_size=3),
        "stop_token_ids": st.lists(token_ids, max_size=3),
        "include_stop_str_in_output": st.booleans(),
        "ignore_eos": st.booleans(),
        "max_tokens": st.one_of(st.none(), st.integers(-1, 24), st.just(MAX_MODEL_LEN)),
        "min_tokens": st.integers(-1, 8),
        "logprobs": st.one_of(st.none(), st.integers(-1, 21)),
        "prompt_logprobs": st.one_of(st.none(), st.integers(-1, 3)),
        "logit_bias": st.one_of(
            st.none(), st.dictionaries(token_ids, _floats(-100.0, 100.0), max_size=4)
        ),
        "allowed_token_ids": st.one_of(st.none(), st.lists(token_ids, max_size=4)),
        "skip_special_tokens": st.booleans(),
        "spaces_between_special_tokens": st.booleans(),
    },
)
prompts = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    st.text(alphabet="The quick brown fox.\n\u00e9", min_size=1, max_size=40),
)


def _run_batch(engine: Any, batch: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
    """Adds every request the validators accept, steps until all finish; returns finals."""
    accepted: dict[str, SamplingParams] = {}
    for i, (prompt, kw) in enumerate(batch):
        try:
            params = SamplingParams(**kw)
            engine.add_request(f"fuzz-{i}", prompt, params)
        except (SamplingParamsError, InvalidRequestError) as e:
            assert getattr(e, "param", None), f"refusal names no field: {e!r}"
            continue
        accepted[f"fuzz-{i}"] = params
    finals: dict[str, Any] = {}
    for rid, out in run_to_finals(engine, MAX_STEPS).items():
        assert out.error is None, out.error
        finals[rid] = (out, accepted[rid])
    assert not engine.has_unfinished_requests(), "requests still running after MAX_STEPS"
    assert set(finals) == set(accepted)
    return finals


def _check_output(out: Any, params: SamplingParams) -> None:
    assert len(out.outputs) == params.n
    for c in out.outputs:
        assert c.finish_reason in ("stop", "length"), c
        assert all(0 <= t < VOCAB for t in c.token_ids), c.token_ids
        if params.max_tokens is not None:
            assert len(c.token_ids) <= params.max_tokens
        assert len(out.prompt_token_ids) + len(c.token_ids) <= MAX_MODEL_LEN
        if params.allowed_token_ids and c.finish_reason == "length":
            assert set(c.token_ids) <= set(params.allowed_token_ids), c.token_ids
        if params.logprobs is not None:
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            for lp in c.logprobs:
                assert not math.isnan(lp.logprob) and lp.logprob <= 1e-4, lp
                assert len(lp.top) <= max(params.logprobs, 0) + 1
    if params.prompt_logprobs is not None and out.prompt_logprobs is not None:
        assert all(lp is None or not math.isnan(lp.logprob) for lp in out.prompt_logprobs)


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same examples on every run: a red build is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=st.lists(st.tuples(prompts, params_kwargs), min_size=1, max_size=3))
def test_arbitrary_sampling_params_never_crash_the_engine(engine: Any, batch: list) -> None:
    finals = _run_batch(engine, batch)
    event(f"{len(finals)} of {len(batch)} requests accepted")
    for out, params in finals.values():
        _check_output(out, params)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, stats
    assert stats.num_running == stats.num_waiting == 0


def test_seeded_sampling_is_reproducible_under_arbitrary_neighbours(engine: Any) -> None:
    """A seeded request's tokens depend only on its seed, never on what shares its batch."""
    kw = {"temperature": 0.9, "top_p": 0.8, "seed": 2**63 - 3, "max_tokens": 10,
          "ignore_eos": True}  # fmt: skip
    alone = _run_batch(engine, [([5, 6, 7], kw)])["fuzz-0"][0].outputs[0].token_ids
    noisy = [([5, 6, 7], kw), ([9, 9], {"temperature": 2.0, "min_p": 0.5, "n": 3}),
             ([1], {"logit_bias": {3: 100.0}, "repetition_penalty": 1e-30})]  # fmt: skip
    assert _run_batch(engine, noisy)["fuzz-0"][0].outputs[0].token_ids == alone
