"""The one KV-fit rule (`engine.core.admission`): what a request holds at its longest."""

from __future__ import annotations

import pytest

from engine.core.admission import fit_lengths, kv_blocks_for, stored_tokens
from engine.errors import InvalidRequestError


def test_the_last_sampled_token_holds_no_kv_and_a_scoring_request_holds_its_prompt():
    assert stored_tokens(10, 7) == 16  # 10 prompt + 6 fed-back outputs
    assert stored_tokens(10, 1) == 10
    assert stored_tokens(10, 0) == 10  # max_tokens 0 (prompt scoring): the prompt only
    assert [kv_blocks_for(n, 4) for n in (1, 4, 5, 16, 17)] == [1, 1, 2, 4, 5]


def test_a_request_that_needs_exactly_the_whole_pool_is_admitted_one_more_token_is_not():
    assert fit_lengths(10, 7, max_model_len=64, block_size=4, num_blocks=4) == 7
    with pytest.raises(InvalidRequestError) as e:
        fit_lengths(10, 8, max_model_len=64, block_size=4, num_blocks=4)
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as e:
        fit_lengths(17, 0, max_model_len=64, block_size=4, num_blocks=4)
    assert e.value.param == "prompt"
