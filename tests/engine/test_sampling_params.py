"""SamplingParams refuses, naming the field, what every frontend would otherwise pass through:
non-finite numbers, seeds outside int64, logit_bias keys that are not canonical token ids,
and masks that leave no token to sample (issue 19, findings 4 and 10)."""

from __future__ import annotations

import math

import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError

FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_non_finite_floats_are_refused_naming_the_field(name, value) -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{name: value})
    assert e.value.param == name


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_logit_bias_values_are_refused(value) -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(logit_bias={5: value})
    assert e.value.param == "logit_bias"


def test_a_boolean_is_not_a_temperature() -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(temperature=True)
    assert e.value.param == "temperature"


@pytest.mark.parametrize("seed", [2**63, 2**64, -(2**63) - 1, 2**80])
def test_seeds_outside_int64_are_refused(seed) -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(seed=seed)
    assert e.value.param == "seed"


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_int64_seeds_are_taken(seed) -> None:
    assert SamplingParams(seed=seed).seed == seed


@pytest.mark.parametrize("key", [" 5", "5 ", "+5", "5_0", "\u0665", "05", "00", "-1", "1e3", ""])
def test_logit_bias_keys_must_be_canonical_decimal_ids(key) -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(logit_bias={key: 1.0})
    assert e.value.param == "logit_bias"


def test_canonical_logit_bias_keys_become_token_ids() -> None:
    assert SamplingParams(logit_bias={"0": 1, "50": -2.5, 7: 3}).logit_bias == {
        0: 1.0,
        50: -2.5,
        7: 3.0,
    }


def test_allowed_ids_all_masked_under_min_tokens_are_refused() -> None:
    eos = {2}
    for kw in (
        {"allowed_token_ids": [2], "min_tokens": 3},  # EOS masked until 3 tokens
        {"allowed_token_ids": [5, 2], "stop_token_ids": [5], "min_tokens": 1},
    ):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**kw).validate_masks(eos)
        assert e.value.param == "allowed_token_ids"
        assert "min_tokens" in e.value.reason


def test_masks_that_leave_a_token_are_accepted() -> None:
    eos = {2}
    SamplingParams(allowed_token_ids=[2], min_tokens=0).validate_masks(eos)
    SamplingParams(allowed_token_ids=[2, 3], min_tokens=3).validate_masks(eos)
    # ignore_eos: EOS is not masked under min_tokens (the runner's rule too).
    SamplingParams(allowed_token_ids=[2], min_tokens=3, ignore_eos=True).validate_masks(eos)
