"""Stop conditions are bounded at admission (issue 19, findings 1 and 3): the count and
length of stop strings and the number of distinct stop token ids are `scheduler` settings,
checked in `prepare_request` (every frontend's path) before anything is built from them, and
a request's stop ids are one frozenset shared by all of its samples."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import ConfigError, SchedulerConfig
from engine.sampling_params import SamplingParams, SamplingParamsError
from tests.support.served_stack import tiny_engine

LIMITS = {"max_stop_strings": 2, "max_stop_string_chars": 8, "max_stop_token_ids": 4}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator:
    yield tiny_engine(tiny_llama_dir, **LIMITS)


def test_defaults_are_sixteen_strings_of_1024_chars_and_1024_ids() -> None:
    c = SchedulerConfig()
    assert (c.max_stop_strings, c.max_stop_string_chars, c.max_stop_token_ids) == (16, 1024, 1024)


@pytest.mark.parametrize("key", sorted(LIMITS))
def test_a_limit_below_one_is_a_config_error_naming_the_key(key: str) -> None:
    with pytest.raises(ConfigError, match=f"^scheduler.{key}:"):
        SchedulerConfig(**{key: 0})


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(stop=["a", "b", "c"]), "stop"),
        (SamplingParams(stop=["ok", "x" * 9]), "stop"),
        (SamplingParams(stop_token_ids=[1, 2, 3, 4, 5]), "stop_token_ids"),
    ],
    ids=["3 strings", "9 chars", "5 distinct ids"],
)
def test_over_a_limit_is_refused_naming_the_field(engine, params, field) -> None:
    with pytest.raises(SamplingParamsError) as info:
        engine.prepare_request("r", "hi", params)
    assert info.value.param == field
    assert str(info.value).startswith(f"{field}: ") and "at most" in str(info.value)


def test_at_the_limits_is_accepted_and_duplicates_count_once(engine) -> None:
    params = SamplingParams(
        n=3, stop=["a", "x" * 8], stop_token_ids=[5] * 100_000 + [6, 7, 8], max_tokens=2
    )
    prepared = engine.prepare_request("r", "hi", params)
    held = [r.sampling_params.stop_token_ids for r in prepared.requests]
    assert held[0] == frozenset({5, 6, 7, 8})
    assert all(ids is held[0] for ids in held)  # one set for the request, not one per sample
