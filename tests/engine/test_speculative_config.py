"""Bad speculative settings are refused at start with a ConfigError naming the key (issue 27's
"Bad input"), in our spelling and in vLLM's `speculative_config` dict; good ones map over.

The draft model's own checks (vocabulary, tokenizer, size) load models and live in
test_speculative_features.py; the YAML path (`speculative:` section) in
tests/serving/test_config_loading.py's table.
"""

from __future__ import annotations

import pytest

from engine.config import (
    MAX_LOOKUP_LEN,
    MAX_SPECULATIVE_TOKENS,
    ConfigError,
    SpeculativeConfig,
    speculative_config_from_dict,
)


@pytest.mark.parametrize(
    "fields, key",
    [
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": -3}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1},
         "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_max"),
        ({"method": "ngram", "prompt_lookup_max": MAX_LOOKUP_LEN + 1}, "prompt_lookup_max"),
        ({"method": "draft"}, "draft_model"),
        ({"method": "ngram", "draft_model": "/some/draft"}, "draft_model"),
        ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"method": "ngram", "step_fixed_cost_tokens": 0.0}, "step_fixed_cost_tokens"),
        ({"method": "suffix", "suffix_max_depth": 0}, "suffix_max_depth"),
        ({"method": "suffix", "suffix_max_depth": MAX_LOOKUP_LEN + 1}, "suffix_max_depth"),
        ({"method": "suffix", "suffix_max_cached_requests": -1}, "suffix_max_cached_requests"),
        ({"method": "suffix", "suffix_min_token_prob": 1.5}, "suffix_min_token_prob"),
        ({"method": "suffix", "suffix_max_spec_factor": 0.0}, "suffix_max_spec_factor"),
        ({"method": "suffix", "suffix_max_spec_factor": 17.0}, "suffix_max_spec_factor"),
    ],
)  # fmt: skip
def test_out_of_range_settings_are_refused_naming_the_key(fields, key):
    with pytest.raises(ConfigError) as ei:
        SpeculativeConfig(**fields)
    assert ei.value.key == f"speculative.{key}"


@pytest.mark.parametrize(
    "spec, key",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative.num_speculative_tokens"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "speculative.suffix_max_depth"),
        ({"method": "ngram", "lookahead": 3}, "speculative.lookahead"),
        ("ngram", "speculative"),
    ],
)
def test_vllm_dicts_with_bad_values_are_refused_naming_the_key(spec, key):
    with pytest.raises(ConfigError) as ei:
        speculative_config_from_dict(spec)
    assert ei.value.key == key


def test_vllm_spellings_map_to_ours():
    cfg = speculative_config_from_dict(
        {"model": "/d", "num_speculative_tokens": 3, "suffix_decoding_min_token_prob": 0.2}
    )
    assert (cfg.method, cfg.draft_model, cfg.num_speculative_tokens) == ("draft", "/d", 3)
    assert cfg.suffix_min_token_prob == 0.2
    assert speculative_config_from_dict({"method": "draft_model", "model": "/d"}).method == "draft"
    ngram = speculative_config_from_dict({"method": "ngram", "prompt_lookup_max": 4})
    assert ngram.enabled and ngram.prompt_lookup_max == 4
    assert not speculative_config_from_dict(None).enabled
