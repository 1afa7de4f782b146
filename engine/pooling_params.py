"""Pooling parameters: what one embedding request asks of the model's pooled vector.

The pooling *method* (last token, mean, CLS) and the model's width belong to the checkpoint
(`engine.worker.pooling.spec.PoolingSpec`); a request only chooses how its vector comes
back. Like `SamplingParams`, a bad field is an `InvalidRequestError` whose message starts
with the field's name, which every frontend answers with a 400 / INVALID_ARGUMENT. What depends on the model (a `dimensions`
above its width, or on a model without Matryoshka training) is checked against the spec at
admission (`PoolingSpec.check`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's `PoolingParams` for embeddings (the fields this engine serves)."""

    # Keep the first `dimensions` features (Matryoshka models only), normalized afterwards
    # when normalization is on. None: the model's full width.
    dimensions: int | None = None
    # L2-normalize the vector. None: as the checkpoint declares (a sentence-transformers
    # Normalize module), or normalized when it declares nothing (vLLM's default).
    normalize: bool | None = None
    # Keep only the prompt's last `truncate_prompt_tokens` tokens (vLLM's left truncation);
    # -1: its last max_model_len tokens. None: never truncate (too long is a 400).
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            _invalid("dimensions", f"must be a positive integer, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            _invalid("normalize", f"must be a boolean, got {self.normalize!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, int) or not (t == -1 or t >= 1)
        ):
            _invalid(
                "truncate_prompt_tokens",
                f"must be -1 (the model's context length) or a positive integer, got {t!r}",
            )

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the model sees it: its last `truncate_prompt_tokens` tokens."""
        t = self.truncate_prompt_tokens
        if t is None:
            return token_ids
        keep = max_model_len if t == -1 else t
        return token_ids[-keep:] if len(token_ids) > keep else token_ids


def _invalid(param: str, reason: str) -> None:
    raise InvalidRequestError(f"{param}: {reason}", param)
