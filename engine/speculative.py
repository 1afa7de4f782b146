"""Speculative decoding from `speculative:` (docs/speculative.md): the pieces, checked.

`build_speculator` makes the scheduler's `Speculator` (None when the method is none);
`load_draft_model` loads the draft of the `draft` method and refuses, with a ConfigError
naming `speculative.draft_model`, a draft the verification could not use: another
vocabulary or tokenizer (its ids would mean other text), or one whose weights are at
least as many bytes as the target's (a decode step reads every weight, so it could never
pay; the same checkpoint kept in 4-bit blocks drafts for its float32 release).
"""

from __future__ import annotations

from engine.config import ConfigError, EngineConfig, ModelConfig, SpeculativeConfig
from engine.core.spec.speculator import Speculator
from engine.output.tokenizer import Tokenizer
from engine.worker.models.loader import load_model
from engine.worker.models.parallel import TensorParallel
from engine.worker.spec.draft_model import DraftModelProposer

_KEY = "speculative.draft_model"


def build_speculator(config: SpeculativeConfig) -> Speculator | None:
    return Speculator(config) if config.enabled else None


def load_draft_model(config: EngineConfig, target, tokenizer: Tokenizer, device, block_size: int):
    """The draft model's proposer on `device`, after checking it against `target` (the
    loaded target model) and its `tokenizer`."""
    spec = config.speculative
    try:
        loaded = load_model(
            ModelConfig(path=spec.draft_model, dtype=config.model.dtype), device,
            TensorParallel(), progress=False,
        )  # fmt: skip
    except ConfigError as e:
        raise ConfigError(_KEY, f"{spec.draft_model!r}: {e.reason}") from e
    except (OSError, ValueError) as e:
        raise ConfigError(_KEY, f"{spec.draft_model!r} cannot be loaded: {e}") from e
    draft = loaded.model
    check_draft(target, draft, tokenizer, Tokenizer.from_pretrained(loaded.model_dir))
    return DraftModelProposer(draft, device, loaded.dtype, block_size, config.runtime)


def check_draft(target, draft, tokenizer: Tokenizer, draft_tokenizer: Tokenizer) -> None:
    """Raises ConfigError unless the draft shares the target's vocabulary and tokenizer and
    is smaller than it."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            _KEY,
            f"the draft's vocabulary has {draft.vocab_size} ids, the target's "
            f"{target.vocab_size}: a draft must use the target's tokenizer",
        )
    if draft_tokenizer.hf.get_vocab() != tokenizer.hf.get_vocab():
        raise ConfigError(_KEY, "the draft's tokenizer maps tokens to other ids than the target's")
    if draft_tokenizer.eos_token_ids != tokenizer.eos_token_ids:
        raise ConfigError(
            _KEY,
            f"the draft's EOS ids {sorted(draft_tokenizer.eos_token_ids)} differ from the "
            f"target's {sorted(tokenizer.eos_token_ids)}",
        )
    n_draft, n_target = weight_bytes(draft), weight_bytes(target)
    if n_draft >= n_target:
        raise ConfigError(
            _KEY,
            f"the draft's weights are {n_draft:,} bytes, the target's {n_target:,}: a draft "
            "must read fewer bytes per token than the target to pay",
        )


def weight_bytes(model) -> int:
    """The bytes of a model's weights: float parameters, and what quantized layers keep
    (their blocks are buffers, not parameters)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if callable(getattr(module, "weight_bytes", None)):
            total += module.weight_bytes()
    return total
