"""Sampling parameters: every OpenAI / vLLM sampling field, validated on construction.

A `ValueError` from here names the offending field first (`"temperature: must be >= 0"`), so
the frontends can turn it into a 400 (or INVALID_ARGUMENT) with `param` set.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
# Seeds are int64, as vLLM takes them: a larger one would wrap (2**64 -> 0) silently.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip
# A logit_bias key given as a string: a canonical decimal token id ("5", not " 5", "+5",
# "5_0", "05" or non-ASCII digits), so two keys never name the same token.
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")


class SamplingParamsError(InvalidRequestError):
    """An invalid sampling field: `reason` says what is wrong, `param` names the field.

    The message is "param: reason"; frontends that name fields by another path (gRPC's
    proto fields) use `reason` with their own name for `param`.
    """

    def __init__(self, reason: str, param: str):
        super().__init__(f"{param}: {reason}", param)
        self.reason = reason


def _check(cond: bool, param: str, reason: str) -> None:
    if not cond:
        raise SamplingParamsError(reason, param)


def _token_id_set(ids: object) -> frozenset[int]:
    """`stop_token_ids` as a frozenset: one C-level pass over what the client sent (cheaper
    than the parse that produced it); the checks then run over the distinct ids."""
    if isinstance(ids, frozenset):
        return ids
    try:
        return frozenset(ids or ())  # type: ignore[arg-type]
    except TypeError:  # not iterable, or unhashable items
        raise SamplingParamsError("must be a list of token ids", "stop_token_ids") from None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's `StructuredOutputsParams`).

    Exactly one kind is set: `json` (a JSON Schema, as a dict or its JSON text),
    `json_object` (any JSON object: OpenAI's `response_format: json_object`), `regex`,
    `choice` (one of these strings) or `grammar` (llguidance's Lark dialect). The grammar
    engine compiles it at admission, off the engine thread; the sampler then masks every
    token the constraint forbids. `start_after`: text after which the constraint starts
    (a reasoning model's end-of-thinking marker such as "</think>"); None: from the first
    generated token. `opened_by` (with `start_after`): the section `start_after` closes is
    optional and open only when the output's first token is this marker (Qwen3's
    "<think>"); any other first token starts the constraint at once.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    start_after: str | None = None
    opened_by: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None
        ] + (["json_object"] if self.json_object else [])
        _check(
            len(kinds) == 1,
            "structured_outputs",
            "exactly one of json, json_object, regex, choice, grammar must be set"
            + (f" (got {', '.join(kinds)})" if kinds else ""),
        )
        if self.choice is not None:
            _check(
                len(self.choice) > 0 and all(isinstance(c, str) and c for c in self.choice),
                "structured_outputs.choice",
                "must be a non-empty list of non-empty strings",
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None
        )


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # Held as a frozenset (duplicates merged) so the per-token stop check is O(1); any
    # iterable of ids is accepted. Its size is bounded at admission (scheduler config).
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len; 0 needs prompt_logprobs
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token (0 = chosen only)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = _token_id_set(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value),
                name,
                f"must be a finite number, got {value!r:.40}",
            )
        _check(self.temperature >= 0.0, "temperature", "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", "must be -1 (disabled) or >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
        if self.max_tokens is not None:
            # 0 makes a prompt-scoring request: prefill, prompt logprobs, nothing generated.
            _check(
                isinstance(self.max_tokens, int)
                and (
                    self.max_tokens >= 1
                    or (self.max_tokens == 0 and self.prompt_logprobs is not None)
                ),
                "max_tokens",
                "must be an integer >= 1, or 0 with prompt_logprobs (score the prompt only)",
            )
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None:
            _check(0 <= self.prompt_logprobs <= 20, "prompt_logprobs", "must be in [0, 20]")
        if self.seed is not None:
            _check(
                isinstance(self.seed, int)
                and not isinstance(self.seed, bool)
                and _SEED_MIN <= self.seed <= _SEED_MAX,
                "seed",
                "must be an integer in [-2**63, 2**63 - 1]",
            )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative token ids",
        )
        if self.logit_bias is not None:
            _check(
                all(math.isfinite(v) and -100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                "logit_bias",
                "values must be finite numbers in [-100, 100]",
            )
            _check(all(k >= 0 for k in self.logit_bias), "logit_bias", "keys must be token ids")
        if self.allowed_token_ids is not None:
            _check(
                len(self.allowed_token_ids) > 0
                and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                "must be a non-empty list of token ids",
            )

    def validate_vocab(self, vocab_size: int) -> None:
        """Checks token ids against the model's vocabulary (the engine knows its size)."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [t for t in ids if t >= vocab_size]
            _check(not bad, name, f"token id {bad[:1]} is outside the vocabulary ({vocab_size})")

    def validate_masks(self, eos_token_ids: Iterable[int]) -> None:
        """Refuses masks that leave no token at the first step (the engine knows the EOS ids):
        every allowed id a stop id, or an EOS id unless `ignore_eos`, while `min_tokens`
        masks those. The sampler ends a request whose masks empty later with an error."""
        if self.allowed_token_ids is None or self.min_tokens == 0:
            return
        masked = set(self.stop_token_ids)
        if not self.ignore_eos:
            masked.update(eos_token_ids)
        _check(
            not masked.issuperset(self.allowed_token_ids),
            "allowed_token_ids",
            f"every allowed id is a stop or EOS id, which min_tokens={self.min_tokens} masks "
            "until that many tokens are generated: no token could be sampled",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _logit_bias(raw: object) -> dict[int, float]:
    """{token id: bias} from a mapping whose keys are ints or canonical decimal strings."""
    if not isinstance(raw, dict):
        raise SamplingParamsError("must be an object of token id -> bias", "logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key):
            tid = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            tid = key
        else:
            raise SamplingParamsError(
                f"keys must be token ids written as plain decimal digits, got {key!r:.40}",
                "logit_bias",
            )
        try:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError
            out[tid] = float(value)
        except (TypeError, OverflowError):
            raise SamplingParamsError(
                f"bias of {key!r:.40} must be a number", "logit_bias"
            ) from None
    return out


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check(self.beam_width >= 1, "beam_width", "must be >= 1")
        _check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
