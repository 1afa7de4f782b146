"""Offline embeddings (`LLM.embed`) against sentence-transformers on tiny random checkpoints:
every architecture with every pooling method, elementwise (atol 1e-4, float32) and in norm,
with prompts chunked across steps and batched with others; plus the request surface
(dimensions, truncation, normalization) and the refusals.

The checks can fail: each case first shows that the reference under another pooling
method, or without its normalization, is far from the expected vectors, so an engine that
swapped the method or dropped the normalization would miss the tolerance.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, PoolingParams, SamplingParams
from engine.config import ConfigError
from engine.errors import ContextLengthError, InvalidRequestError
from tests.support.tiny_embedders import st_encode, st_pooled_unnormalized

TEXTS = [
    "The capital of France is Paris.",
    "a",
    "Once upon a time there was a little girl who lived in a village near the forest.",
    "Hello, how are you today?",
    "Water boils at one hundred degrees. The earth goes around the sun once every year.",
]
ATOL = 1e-4
MAX_MODEL_LEN = 128


@pytest.fixture(scope="session")
def embedder(tiny_embedder: Callable[..., Path]) -> Callable[..., Path]:
    return tiny_embedder


def make_llm(model_dir: Path, **kw: Any) -> LLM:
    settings = dict(device="cpu", num_threads=1, num_kv_blocks=64, block_size=16,
                    max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=8)  # fmt: skip
    return LLM(str(model_dir), **{**settings, **kw})


def embed(llm: LLM, prompts, params: PoolingParams | None = None) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(prompts, params, use_tqdm=False)])


# Every architecture with every pooling method; the layouts alternate (bare decoder saved by
# sentence-transformers / causal LM with the older module files beside it), and two cases
# have no Normalize module.
CASES = [
    ("llama", "last", True, True),
    ("llama", "mean", False, True),
    ("llama", "cls", True, False),
    ("mistral", "last", False, True),
    ("mistral", "mean", True, True),
    ("mistral", "cls", False, True),
    ("qwen2", "last", True, True),
    ("qwen2", "mean", False, False),
    ("qwen2", "cls", True, True),
    ("qwen3", "last", False, True),
    ("qwen3", "mean", True, True),
    ("qwen3", "cls", False, True),
]


@pytest.mark.parametrize(("arch", "pooling", "bare", "normalize"), CASES)
def test_embeddings_equal_sentence_transformers(embedder, arch, pooling, bare, normalize):
    model_dir = embedder(arch, pooling, bare=bare, normalize=normalize)
    ref = st_encode(model_dir, TEXTS)
    # The test's power: another method, or the raw vector, is far outside the tolerance.
    for other in {"last", "mean", "cls"} - {pooling}:
        wrong = st_pooled_unnormalized(model_dir, TEXTS, other)
        if normalize:
            wrong = torch.nn.functional.normalize(wrong, dim=1)
        assert (wrong - ref).abs().max() > 100 * ATOL, f"{other} pooling is not told apart"
    raw = st_pooled_unnormalized(model_dir, TEXTS, pooling)
    if normalize:
        assert (raw.norm(dim=1) - 1).abs().min() > 100 * ATOL, "normalization is not visible"
    else:
        assert torch.allclose(raw, ref, atol=1e-6)

    llm = make_llm(model_dir)  # an 8-token budget: prompts chunked and batched together
    ours = embed(llm, TEXTS)
    assert ours.shape == ref.shape == (len(TEXTS), 64)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.norm(dim=1), ref.norm(dim=1), atol=ATOL, rtol=0)


def test_mixed_length_batch_equals_one_by_one(embedder):
    llm = make_llm(embedder("qwen3", "mean"), max_num_batched_tokens=2048)
    batch = embed(llm, TEXTS)
    alone = torch.cat([embed(llm, [t]) for t in TEXTS])
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=0)


def test_token_id_prompts_equal_their_text(embedder):
    llm = make_llm(embedder("llama", "last"))
    ids = [llm.tokenizer.encode(t) for t in TEXTS[:2]]
    torch.testing.assert_close(embed(llm, ids), embed(llm, TEXTS[:2]), atol=0, rtol=0)
    torch.testing.assert_close(embed(llm, ids[0]), embed(llm, TEXTS[0]), atol=0, rtol=0)


def test_matryoshka_dimensions_equal_the_truncated_reference(embedder):
    model_dir = embedder("qwen3", "last", matryoshka=True)
    llm = make_llm(model_dir)
    ours = embed(llm, TEXTS, PoolingParams(dimensions=16))
    ref = st_encode(model_dir, TEXTS, truncate_dim=16, normalize=True)
    assert ours.shape == (len(TEXTS), 16)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    full = embed(llm, TEXTS, PoolingParams(dimensions=64))
    torch.testing.assert_close(full, st_encode(model_dir, TEXTS), atol=ATOL, rtol=0)


def test_normalize_false_returns_the_raw_pooled_vector(embedder):
    model_dir = embedder("mistral", "mean", bare=True)
    llm = make_llm(model_dir)
    ours = embed(llm, TEXTS, PoolingParams(normalize=False))
    torch.testing.assert_close(
        ours, st_pooled_unnormalized(model_dir, TEXTS, "mean"), atol=ATOL, rtol=0
    )


def test_model_pooling_and_normalize_settings_override_the_checkpoint(embedder):
    model_dir = embedder("qwen2", "last", bare=True)
    llm = make_llm(model_dir, pooling="cls", normalize=False)
    torch.testing.assert_close(
        embed(llm, TEXTS), st_pooled_unnormalized(model_dir, TEXTS, "cls"), atol=ATOL, rtol=0
    )


def test_truncate_prompt_tokens_keeps_the_last_tokens(embedder):
    llm = make_llm(embedder("llama", "mean", bare=False))
    ids = llm.tokenizer.encode(TEXTS[2])
    cut = embed(llm, TEXTS[2], PoolingParams(truncate_prompt_tokens=5))
    torch.testing.assert_close(cut, embed(llm, [ids[-5:]]), atol=0, rtol=0)
    long_ids = (ids * 20)[: MAX_MODEL_LEN + 40]
    whole = embed(llm, [long_ids], PoolingParams(truncate_prompt_tokens=-1))
    torch.testing.assert_close(whole, embed(llm, [long_ids[-MAX_MODEL_LEN:]]), atol=0, rtol=0)
    kw = llm.embed([ids], truncate_prompt_tokens=5, use_tqdm=False)  # vLLM's keyword
    torch.testing.assert_close(torch.tensor([kw[0].outputs.embedding]), cut, atol=0, rtol=0)
    assert kw[0].prompt_token_ids == ids[-5:]


def test_embedding_keeps_no_kv_and_writes_nothing_to_the_prefix_cache(embedder):
    llm = make_llm(embedder("qwen3", "last"))
    embed(llm, TEXTS + TEXTS)
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.pool.num_cached_blocks == 0
    stats = llm.engine.stats()
    assert stats.prefix_cache_queries == 0 and stats.generation_tokens_total == 0


def test_input_may_fill_the_context_but_not_more(embedder):
    llm = make_llm(embedder("llama", "last"))
    ids = list(range(10, 10 + MAX_MODEL_LEN))
    assert embed(llm, [ids]).shape == (1, 64)
    with pytest.raises(ContextLengthError, match=f"maximum context length is {MAX_MODEL_LEN}"):
        llm.embed([ids + [10]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt must not be empty"):
        llm.embed([""], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="at least one token"):
        llm.embed([[]], use_tqdm=False)


def test_dimensions_above_the_width_or_without_matryoshka_are_refused(embedder):
    llm = make_llm(embedder("qwen3", "last"))
    with pytest.raises(InvalidRequestError, match="at most 64") as err:
        llm.embed(["x"], PoolingParams(dimensions=65), use_tqdm=False)
    assert err.value.param == "dimensions"
    with pytest.raises(InvalidRequestError, match="does not declare Matryoshka"):
        llm.embed(["x"], PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="dimensions: must be a positive integer"):
        PoolingParams(dimensions=0)


def test_each_model_refuses_the_other_task(embedder, tiny_llama_dir):
    emb = make_llm(embedder("qwen3", "last"))
    assert emb.engine.task == "embed" and emb.engine.embedding_size == 64
    with pytest.raises(InvalidRequestError, match="has task 'embed'") as err:
        emb.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert err.value.param == "model"
    gen = make_llm(tiny_llama_dir)
    assert gen.engine.task == "generate" and gen.engine.embedding_size is None
    with pytest.raises(InvalidRequestError, match="has task 'generate'"):
        gen.embed(["hi"], use_tqdm=False)


def test_a_causal_checkpoint_can_be_embedded_by_setting_the_task(tiny_llama_dir):
    """No sentence-transformers files: last token, normalized (vLLM's default)."""
    llm = make_llm(tiny_llama_dir, task="embed")
    v = embed(llm, TEXTS[:2])
    torch.testing.assert_close(v.norm(dim=1), torch.ones(2), atol=1e-5, rtol=0)


def test_bare_decoder_cannot_generate_and_unsupported_modules_are_refused(embedder, tmp_path):
    model_dir = embedder("llama", "last")
    with pytest.raises(ConfigError, match="model.task: generate needs an LM head"):
        make_llm(model_dir, task="generate")
    bad = tmp_path / "dense"
    shutil.copytree(model_dir, bad)
    modules = json.loads((bad / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense",
                    "type": "sentence_transformers.models.Dense"})  # fmt: skip
    (bad / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="module 'sentence_transformers.models.Dense' is not"):
        make_llm(bad)
    (bad / "modules.json").write_text(json.dumps(modules[:2]))
    (bad / "1_Pooling" / "config.json").write_text(
        json.dumps({"embedding_dimension": 64, "pooling_mode": "max"})
    )
    with pytest.raises(ConfigError, match="pooling mode 'max' is not supported"):
        make_llm(bad)
