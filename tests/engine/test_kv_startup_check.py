"""Start-up refuses a KV pool that cannot hold one request of model.max_model_len tokens.

Otherwise the server starts and then refuses every request that asks for the whole context
(a chat request without max_tokens). The check is admission's own KV-fit rule
(`engine.core.admission.max_request_blocks`), named after the setting that sized the pool.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.core.admission import fit_lengths, max_request_blocks

BLOCK = 4


def test_explicit_pool_smaller_than_one_max_length_request_refuses_to_start(tiny_llama_dir):
    # 64 tokens: one 512-token request needs ceil(511 / 4) = 128 blocks.
    with pytest.raises(ConfigError) as e:
        LLM(str(tiny_llama_dir), num_kv_blocks=16, block_size=BLOCK, max_model_len=512)
    msg = str(e.value)
    assert e.value.key == "cache.num_kv_blocks"
    assert msg.startswith("cache.num_kv_blocks: cache.num_kv_blocks=16 gives 16 KV blocks")
    assert "model.max_model_len=512 request needs 128" in msg


def test_cpu_gib_pool_smaller_than_one_max_length_request_names_cpu_kv_cache_gib(
    tiny_llama_dir,
):
    with pytest.raises(ConfigError) as e:
        LLM(str(tiny_llama_dir), kv_cache_gib=1e-6, block_size=BLOCK, max_model_len=512)
    assert e.value.key == "cache.cpu_kv_cache_gib"
    assert "model.max_model_len=512" in str(e.value)


def test_pool_of_exactly_one_max_length_request_starts_and_serves_it(tiny_llama_dir):
    max_model_len = 17  # the longest request holds K/V for 16 tokens: 4 blocks
    need = max_request_blocks(max_model_len, BLOCK)
    assert need == 4
    llm = LLM(
        str(tiny_llama_dir), num_kv_blocks=need, block_size=BLOCK, dtype="float32",
        max_model_len=max_model_len,
    )  # fmt: skip
    prompt = list(range(10, 26))  # 16 tokens: max_tokens left unset takes the one token left
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=None), use_tqdm=False)[
        0
    ]
    assert len(out.outputs[0].token_ids) == 1
    # The start-up check and admission are one rule: one block fewer is refused by both.
    assert fit_lengths(16, None, max_model_len, BLOCK, need) == 1
    with pytest.raises(ConfigError):
        LLM(str(tiny_llama_dir), num_kv_blocks=need - 1, block_size=BLOCK,
            max_model_len=max_model_len)  # fmt: skip
