"""What an embedding checkpoint declares: its task, pooling method, normalization, width.

Embedding checkpoints are sentence-transformers directories: `modules.json` lists the
pipeline (a Transformer, then Pooling, then optionally Normalize), `1_Pooling/config.json`
names the pooling mode. Decoder-only embedders (Qwen3-Embedding, gte-Qwen2, e5-mistral)
name either the bare decoder (`Qwen3Model`: no LM head, weights without the `model.`
prefix) or a CausalLM class with those files beside it. `model.task: auto` reads either as
an embedding model.

Pooling methods served: last token (`lasttoken`), mean over the prompt, and CLS (the first
token). Anything else in a checkpoint (max, weighted mean, several modes concatenated, a
Dense or other module after pooling, `include_prompt: false`) is refused at start-up with
the module and key named, rather than served as something else. A checkpoint with no
sentence-transformers files embeds by its last token, normalized (vLLM's default for
decoder models), and says so in the start-up log.

Matryoshka (`dimensions` below the full width) is allowed only where the checkpoint's
config.json says so (`is_matryoshka`, `matryoshka_dimensions`, as vLLM reads them) or
`model.is_matryoshka` does: truncating a model not trained for it gives poor vectors
silently, so such a request is refused instead.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ConfigError, ModelConfig
from engine.errors import InvalidRequestError
from engine.pooling_params import PoolingParams

# sentence-transformers' pooling modes -> ours.
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
# Its older configs: one boolean per mode (the first true one wins, mean when none is).
_ST_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolingSpec:
    """How this model turns hidden states into one vector (fixed at start-up)."""

    method: str  # last | mean | cls
    normalize: bool  # a request's default (PoolingParams.normalize None)
    hidden_size: int  # the full vector's width
    matryoshka: bool  # `dimensions` below hidden_size allowed
    matryoshka_dims: tuple[int, ...] | None = None  # the only widths allowed, when declared
    # sentence-transformers' Transformer settings: inputs longer than max_seq_length are
    # not embedded by the reference (it truncates); do_lower_case lowercases text inputs.
    max_seq_length: int | None = None
    do_lower_case: bool = False
    source: str = "sentence-transformers modules.json"  # where method and normalize came from

    def __str__(self) -> str:
        m = "matryoshka" if self.matryoshka else "no matryoshka"
        return (
            f"pooling {self.method}, normalize {self.normalize}, dim {self.hidden_size}, "
            f"{m} ({self.source})"
        )

    def check(self, params: PoolingParams) -> None:
        """Raises InvalidRequestError (param `dimensions`) unless this model can serve it."""
        d = params.dimensions
        if d is None:
            return
        if d > self.hidden_size:
            raise InvalidRequestError(
                f"dimensions: at most {self.hidden_size} (this model's embedding size), got {d}",
                "dimensions",
            )
        if d == self.hidden_size:
            return
        if not self.matryoshka:
            raise InvalidRequestError(
                f"dimensions: this model does not declare Matryoshka support, so its "
                f"{self.hidden_size}-dimensional embeddings cannot be shortened (set "
                "model.is_matryoshka if it was trained for it)",
                "dimensions",
            )
        if self.matryoshka_dims is not None and d not in self.matryoshka_dims:
            allowed = ", ".join(map(str, self.matryoshka_dims))
            raise InvalidRequestError(
                f"dimensions: this model serves {allowed} or {self.hidden_size}, got {d}",
                "dimensions",
            )

    def normalizes(self, params: PoolingParams) -> bool:
        return self.normalize if params.normalize is None else params.normalize


def declares_embedding(model_dir: Path) -> bool:
    """True when the directory is a sentence-transformers model (its modules.json)."""
    return (model_dir / "modules.json").is_file()


def resolve_task(requested: str, model_dir: Path, architecture: str, bare: bool) -> str:
    """`generate` or `embed` for `model.task` = `requested` (auto | generate | embed).

    auto: embed for a bare decoder (no LM head) or a sentence-transformers directory, else
    generate. A bare decoder cannot generate: ConfigError naming model.task."""
    if requested == "generate" and bare:
        raise ConfigError(
            "model.task",
            f"generate needs an LM head, and {architecture} checkpoints have none (they are "
            "embedding models: set model.task to auto or embed)",
        )
    if requested != "auto":
        return requested
    return "embed" if bare or declares_embedding(model_dir) else "generate"


def read_pooling_spec(model_dir: Path, hf_config: Any, model: ModelConfig) -> PoolingSpec:
    """The checkpoint's pooling (overridden by model.pooling / model.normalize)."""
    hidden = int(hf_config.hidden_size)
    method, normalize, source = "last", True, "default: no sentence-transformers modules.json"
    bert: dict[str, Any] = {}
    if declares_embedding(model_dir):
        method, normalize, bert = _read_modules(model_dir, hidden)
        source = "sentence-transformers modules.json"
    overridden = []
    if model.pooling is not None:
        method = model.pooling
        overridden.append("model.pooling")
    if model.normalize is not None:
        normalize = model.normalize
        overridden.append("model.normalize")
    if overridden:
        source += "; " + ", ".join(overridden)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False)) or dims is not None
    if model.is_matryoshka is not None:
        matryoshka = model.is_matryoshka
    max_seq = bert.get("max_seq_length")
    return PoolingSpec(
        method=method,
        normalize=normalize,
        hidden_size=hidden,
        matryoshka=matryoshka,
        matryoshka_dims=tuple(int(d) for d in dims) if matryoshka and dims else None,
        max_seq_length=int(max_seq) if isinstance(max_seq, int) and max_seq > 0 else None,
        do_lower_case=bool(bert.get("do_lower_case", False)),
        source=source,
    )


def embedding_max_len(model: ModelConfig, resolved: int, spec: PoolingSpec | None) -> int:
    """The context length of an embedding model: `resolved` (model.max_model_len or the
    checkpoint's positions), capped at sentence-transformers' max_seq_length unless
    model.max_model_len was set (as vLLM caps it)."""
    if spec is None or spec.max_seq_length is None or model.max_model_len is not None:
        return resolved
    return min(resolved, spec.max_seq_length)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("model.path", f"{path} cannot be read as JSON: {e}") from None


def _read_modules(model_dir: Path, hidden: int) -> tuple[str, bool, dict[str, Any]]:
    """(method, normalize, sentence_bert_config) from a sentence-transformers directory."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError("model.path", f"{model_dir}/modules.json is not a list of modules")
    method: str | None = None
    normalize = False
    bert: dict[str, Any] = {}
    for i, m in enumerate(sorted(modules, key=lambda m: m.get("idx", 0))):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        path = str(m.get("path", ""))
        if kind not in _SUPPORTED_MODULES:
            raise ConfigError(
                "model.path",
                f"{model_dir}: sentence-transformers module {m.get('type')!r} is not supported "
                f"(served: {', '.join(_SUPPORTED_MODULES)})",
            )
        if (kind == "Transformer") != (i == 0):
            raise ConfigError(
                "model.path", f"{model_dir}: modules.json must start with its one Transformer"
            )
        if kind == "Transformer":
            if path not in ("", "."):
                raise ConfigError(
                    "model.path",
                    f"{model_dir}: the Transformer module lives in {path!r}; point model.path "
                    "at that directory",
                )
            bert_path = model_dir / "sentence_bert_config.json"
            bert = _read_json(bert_path) if bert_path.is_file() else {}
            if "message" in (bert.get("modality_config") or {}):
                logger.warning(
                    "%s: sentence-transformers >= 6 renders text inputs of this model through "
                    "its chat template (modality 'message'); this engine embeds the text as "
                    "given, as vLLM does (send the rendered text to match it)",
                    model_dir,
                )
        elif kind == "Pooling":
            if method is not None:
                raise ConfigError("model.path", f"{model_dir}: two Pooling modules")
            method = _pooling_method(model_dir / path / "config.json", hidden)
        elif kind == "Normalize":
            if method is None:
                raise ConfigError("model.path", f"{model_dir}: Normalize before Pooling")
            normalize = True
    if method is None:
        raise ConfigError("model.path", f"{model_dir}: modules.json has no Pooling module")
    return method, normalize, bert


def _pooling_method(path: Path, hidden: int) -> str:
    cfg = _read_json(path)
    if not isinstance(cfg, dict):
        raise ConfigError("model.path", f"{path} is not a JSON object")
    mode = cfg.get("pooling_mode")
    if mode is None:
        active = [m for key, m in _ST_LEGACY_KEYS.items() if cfg.get(key)]
        mode = active if active else "mean"
    if isinstance(mode, list):
        if len(mode) != 1:
            raise ConfigError(
                "model.path", f"{path}: pooling modes {mode} concatenated are not supported"
            )
        mode = mode[0]
    if mode not in _ST_MODES:
        served = ", ".join(_ST_MODES)
        raise ConfigError(
            "model.path", f"{path}: pooling mode {mode!r} is not supported ({served})"
        )
    if cfg.get("include_prompt", True) is not True:
        raise ConfigError("model.path", f"{path}: include_prompt false is not supported")
    width = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension"))
    if width is not None and width != hidden:
        raise ConfigError(
            "model.path", f"{path}: embedding_dimension {width} != the model's hidden_size {hidden}"
        )
    return _ST_MODES[mode]
