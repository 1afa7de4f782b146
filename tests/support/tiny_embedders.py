"""Tiny random embedding checkpoints (sentence-transformers directories) and the reference.

Two layouts, as published embedding models come:

- `bare=True`: saved by sentence-transformers itself (its current format): the bare decoder
  (`Qwen3Model`, weights without the `model.` prefix, no LM head), `1_Pooling/config.json`
  with `pooling_mode`, a `2_Normalize` module when normalized;
- `bare=False`: a causal LM checkpoint (`Qwen3ForCausalLM`, with its LM head) and, beside
  it, hand-written module files in the older format (the `pooling_mode_*` booleans) that
  checkpoints such as Qwen3-Embedding ship.

`sentence_bert_config.json` is written in the classic text-only form (`max_seq_length`,
`do_lower_case`), so sentence-transformers tokenizes inputs as plain text, as it does for
published models (its >= 6 default for a fresh model with a chat template is to render the
text through the template instead; see engine/worker/pooling/spec.py). Nothing is
downloaded; `st_encode` is the sentence-transformers reference the engine is checked against.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

from tests.support.tiny_models import make_tiny_checkpoint

# Our names -> sentence-transformers' pooling modes.
ST_MODES = {"last": "lasttoken", "mean": "mean", "cls": "cls"}
_LEGACY_KEYS = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "last": "pooling_mode_lasttoken",
}
_MODULE_TYPES = {
    "Transformer": "sentence_transformers.models.Transformer",
    "Pooling": "sentence_transformers.models.Pooling",
    "Normalize": "sentence_transformers.models.Normalize",
}


def make_tiny_embedder(
    out_dir: str | Path,
    arch: str = "qwen3",
    pooling: str = "last",
    *,
    normalize: bool = True,
    bare: bool = True,
    matryoshka: bool = False,
    max_seq_length: int = 512,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """A tiny random `arch` embedding model pooled by `pooling` (last | mean | cls)."""
    out = Path(out_dir)
    if bare:
        causal = make_tiny_checkpoint(out.with_name(out.name + "-causal"), arch, seed=seed,
                                      **overrides)  # fmt: skip
        _save_with_sentence_transformers(causal, out, pooling, normalize)
        shutil.rmtree(causal)
    else:
        make_tiny_checkpoint(out, arch, seed=seed, **overrides)
        _write_legacy_modules(out, pooling, normalize)
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )
    if matryoshka:
        cfg = json.loads((out / "config.json").read_text())
        cfg["is_matryoshka"] = True
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _save_with_sentence_transformers(causal: Path, out: Path, pooling: str, normalize: bool):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    t = Transformer(str(causal))
    modules = [t, Pooling(t.get_embedding_dimension(), ST_MODES[pooling])]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))


def _write_legacy_modules(out: Path, pooling: str, normalize: bool) -> None:
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "", "type": _MODULE_TYPES["Transformer"]}]
    (out / "1_Pooling").mkdir(exist_ok=True)
    pool_cfg: dict[str, Any] = {"word_embedding_dimension": hidden, "include_prompt": True}
    for name, key in _LEGACY_KEYS.items():
        pool_cfg[key] = name == pooling
    pool_cfg.update(pooling_mode_max_tokens=False, pooling_mode_mean_sqrt_len_tokens=False,
                    pooling_mode_weightedmean_tokens=False)  # fmt: skip
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pool_cfg, indent=2))
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": _MODULE_TYPES["Pooling"]})
    if normalize:
        (out / "2_Normalize").mkdir(exist_ok=True)
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": _MODULE_TYPES["Normalize"]}
        )
    (out / "modules.json").write_text(json.dumps(modules, indent=2))


@functools.lru_cache(maxsize=32)
def _st_model(model_dir: str) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(
        model_dir, device="cpu", model_kwargs={"attn_implementation": "eager"}
    )


def st_encode(
    model_dir: str | Path,
    texts: list[str],
    *,
    truncate_dim: int | None = None,
    normalize: bool = False,
    batch_size: int = 32,
) -> Any:
    """sentence-transformers' embeddings of `texts` [N, D] (float32 torch tensor).
    `normalize`: normalize after truncation too (what a `dimensions` request returns)."""
    model = _st_model(str(Path(model_dir).resolve()))
    return model.encode(
        texts,
        convert_to_tensor=True,
        batch_size=batch_size,
        truncate_dim=truncate_dim,
        normalize_embeddings=normalize,
    ).float()


def st_pooled_unnormalized(model_dir: str | Path, texts: list[str], pooling: str) -> Any:
    """The same checkpoint's vectors pooled by `pooling`, with no Normalize step: what a
    mutation of the engine (another pooling method, normalization dropped) would return."""
    import torch
    from sentence_transformers.sentence_transformer.modules import Pooling

    model = _st_model(str(Path(model_dir).resolve()))
    transformer = model[0]
    features = model.preprocess(texts)
    with torch.no_grad():
        out = transformer(features)
        pooled = Pooling(transformer.get_embedding_dimension(), ST_MODES[pooling])(out)
    return pooled["sentence_embedding"].float()
