"""One row of a step's logits as the sampler sees it: its request's sampling state.

Built by the runner (engine/worker/runner.py) for every row it samples, read by the sampler
and by what edits logits before it (engine/worker/logits_processing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

__all__ = ["SamplingRow"]


@dataclass
class SamplingRow:
    """One row of the logits matrix: what the sampler needs to know about its request."""

    params: SamplingParams
    # Prompt then output token ids, read only by penalties: the runner passes its own list
    # (no copy) when `params.needs_penalties`, else nothing, so a step costs no O(length).
    token_ids: Sequence[int]
    num_prompt_tokens: int
    # Generated so far (for min_tokens); always set.
    num_output_tokens: int
    # Per-request generator, from `make_generator(params.seed, device)`; None when unseeded.
    generator: torch.Generator | None = None
    # EOS ids suppressed (with params.stop_token_ids) while fewer than params.min_tokens
    # tokens have been generated. Empty: only params.stop_token_ids are suppressed.
    eos_token_ids: Sequence[int] = ()
    # True when the step's grammar bitmask has a row for this request (structured outputs
    # with its grammar active): the sampler masks what the grammar forbids.
    grammar: bool = False
    # The generator is reseeded with this right before the row's draw
    # (`position_seed(params.seed, output position)`); None: draw from it as it stands.
    position_seed: int | None = None
