"""Speculative decoding with structured outputs, LoRA and tensor parallelism (each equal
to its run without speculation, with proposals made, accepted and rejected), and the
draft model's start-up checks.

Structured outputs: the grammar masks every verified position as of that position and is
rolled back over rejected proposals; its forced tokens (JSON keys, punctuation) are
proposed for free. A grammar that starts after a marker (`start_after`) is played forward
over the proposals on a copy until the marker completes.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from engine.config import ConfigError, ModelConfig
from engine.speculative import weight_bytes
from engine.worker.models.loader import load_model
from tests.engine.test_speculative_equality import (
    _assert_speculated,
    _checkpoint,
    _draft_of,
    _greedy,
    _llm,
    _prompts,
    _run,
    _speculative,
)
from tests.support.schemas import JSON_SCHEMAS
from tests.support.tiny_lora import make_tiny_adapter

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def _structured(spec: StructuredOutputsParams, i: int) -> SamplingParams:
    # Greedy and seeded samples: both must be the same with and without speculation.
    if i % 2:
        return SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=spec)
    return SamplingParams(temperature=0.8, seed=i, max_tokens=60, structured_outputs=spec)


def test_structured_outputs_equal_their_output_without_speculation(tiny_checkpoint):
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    prompts = [p[:8] for p in _prompts(2)] * 2
    specs = [StructuredOutputsParams(json=schema) for _, schema in JSON_SCHEMAS[:3]]
    specs.append(StructuredOutputsParams(regex=r"(ab|cd){3,12}x"))
    params = [_structured(specs[i % len(specs)], i) for i in range(len(prompts))]
    expected = _run(_llm(model_dir, max_model_len=256), prompts, params)
    llm = _llm(model_dir, NGRAM, max_model_len=256)
    assert _run(llm, prompts, params) == expected
    assert sum(c[0][2] == "stop" for c in expected) >= 4  # some grammars completed
    _assert_speculated(llm.engine.stats())


def test_a_grammar_that_starts_after_a_marker_equals_too(tiny_checkpoint):
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    prompts = [p[:8] for p in _prompts(4)]
    free = _run(_llm(model_dir), prompts, _greedy(max_tokens=30))
    # Each request's marker: two characters of its own unconstrained text, so the grammar
    # starts part-way (proposals may complete the marker inside a verified run).
    params = []
    for out in free:
        text = out[0][1]
        marker = text[len(text) // 3 : len(text) // 3 + 2]
        spec = StructuredOutputsParams(regex=r"[a-z ]{1,20}\.", start_after=marker)
        params.append(SamplingParams(temperature=0.0, max_tokens=50, structured_outputs=spec))
    expected = _run(_llm(model_dir), prompts, params)
    llm = _llm(model_dir, NGRAM)
    assert _run(llm, prompts, params) == expected
    _assert_speculated(llm.engine.stats())


def test_lora_applies_in_verification(tiny_checkpoint, tmp_path):
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    adapter = make_tiny_adapter(model_dir, tmp_path / "a", r=4, alpha=8, seed=3, std=0.02)
    lora = LoRARequest("a", 1, str(adapter))
    prompts = _prompts(6)
    loras = [lora if i % 2 else None for i in range(len(prompts))]

    def run(spec):
        llm = _llm(model_dir, spec, enable_lora=True, max_lora_rank=8)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(),
                            use_tqdm=False, lora_request=loras)  # fmt: skip
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats()

    expected, _ = run(None)
    got, stats = run({"method": "suffix", "num_speculative_tokens": 4})
    assert got == expected
    _assert_speculated(stats)


def test_tensor_parallel_ranks_verify_the_same_proposals(tiny_checkpoint):
    """TP=2 with n-gram speculation against TP=1 without: the proposals reach rank 1 in
    the step message, and it keeps its tokens and block tables in step with rank 0."""
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    prompts = _prompts(8)
    kw = dict(num_kv_blocks=40, max_num_batched_tokens=16, max_num_seqs=8)
    expected = _run(_llm(model_dir, **kw), prompts, _greedy())
    llm = _llm(model_dir, NGRAM, tensor_parallel_size=2, device="cpu", **kw)
    try:
        assert _run(llm, prompts, _greedy()) == expected
        stats = llm.engine.stats()
        _assert_speculated(stats)
        assert stats.num_preemptions > 0
    finally:
        llm.close()


# ---- the draft model's checks -----------------------------------------------------------------


def test_a_draft_as_large_as_the_target_is_refused(tiny_checkpoint):
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    with pytest.raises(ConfigError, match="speculative.draft_model: the draft's weights are"):
        _llm(model_dir, {"model": str(model_dir)})


def test_draft_size_counts_quantized_blocks_as_bytes(tiny_checkpoint):
    """The same checkpoint quantized to 4-bit blocks reads fewer bytes than its float self
    (a valid draft), and a quantized layer's blocks count (they are buffers)."""
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    cpu = torch.device("cpu")
    dense = load_model(ModelConfig(path=str(model_dir), dtype="float32"), cpu).model
    q4 = load_model(ModelConfig(path=str(model_dir), dtype="float32", quantization="int4"), cpu)
    assert 0 < 2 * weight_bytes(q4.model) < weight_bytes(dense)  # tiny: q8 embeddings weigh
    blocks = sum(m.qdata.numel() for m in q4.model.modules() if hasattr(m, "qdata"))
    assert weight_bytes(q4.model) > blocks > 0


def test_a_draft_with_another_vocabulary_is_refused(tiny_checkpoint):
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    other = tiny_checkpoint("llama", weight_std=0.05, num_hidden_layers=1, vocab_size=600)
    with pytest.raises(ConfigError, match="speculative.draft_model: the draft's vocabulary"):
        _llm(model_dir, {"model": str(other)})


def test_a_draft_with_another_tokenizer_is_refused(tiny_checkpoint, tmp_path):
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    draft = shutil.copytree(_draft_of(model_dir), tmp_path / "draft")
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]  # same size, two ids swapped
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="draft's tokenizer maps tokens to other ids"):
        _llm(model_dir, {"model": str(draft)})


def test_a_missing_draft_is_refused_by_name(tiny_checkpoint, tmp_path):
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    with pytest.raises(ConfigError, match="speculative.draft_model"):
        _llm(model_dir, {"model": str(tmp_path / "nowhere")})


def test_draft_kv_shares_the_target_block_ids_and_is_counted_in_sizing(tiny_checkpoint):
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    spec = _speculative("draft", model_dir)
    plain = LLM(str(model_dir), dtype="float32", kv_cache_gib=0.01, max_model_len=128)
    drafted = LLM(str(model_dir), dtype="float32", kv_cache_gib=0.01, max_model_len=128,
                  speculative_config=spec)  # fmt: skip
    proposer = drafted.engine.runner.proposer
    # 2 target layers + 1 draft layer of the same shape: 2/3 of the blocks in the same bytes.
    assert drafted.engine.stats().num_blocks == plain.engine.stats().num_blocks * 2 // 3
    assert proposer.kv_caches[0].shape[0] == drafted.engine.stats().num_blocks
