"""Shared fixtures: tiny random HF checkpoints built once per session, offline.

torch and transformers are imported inside the fixtures, never at import time: tests/core
runs without them (tests/test_import_graph.py checks it with both made unimportable).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `tiny_checkpoint(arch="llama", **overrides) -> Path`, cached per session.

    Overrides are those of `tests.support.tiny_models.make_tiny_checkpoint` (tie_word_embeddings,
    sliding_window, rope_scaling, max_shard_size, seed, any config field).
    """
    from tests.support.tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_ckpts")
    cache: dict[str, Path] = {}

    def build(arch: str = "llama", **overrides: Any) -> Path:
        key = json.dumps([arch, overrides], sort_keys=True, default=str)
        if key not in cache:
            cache[key] = make_tiny_checkpoint(root / f"{arch}-{len(cache)}", arch, **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    """A default tiny Llama checkpoint directory (fp32, untied, single safetensors file)."""
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_embedder(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `tiny_embedder(arch="qwen3", pooling="last", **kw) -> Path`, a tiny
    sentence-transformers directory cached per session (kw: those of
    `tests.support.tiny_embedders.make_tiny_embedder`: bare, normalize, matryoshka, ...)."""
    from tests.support.tiny_embedders import make_tiny_embedder

    root = tmp_path_factory.mktemp("tiny_embedders")
    cache: dict[str, Path] = {}

    def build(arch: str = "qwen3", pooling: str = "last", **kw: Any) -> Path:
        key = json.dumps([arch, pooling, kw], sort_keys=True)
        if key not in cache:
            out = root / f"{arch}-{pooling}-{len(cache)}"
            cache[key] = make_tiny_embedder(out, arch, pooling, **kw)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[..., list[list[int]]]:
    """`hf_greedy(model_dir, prompt_token_ids_list, max_new_tokens, ignore_eos=False)`."""
    from tests.support.tiny_models import hf_greedy

    return hf_greedy
