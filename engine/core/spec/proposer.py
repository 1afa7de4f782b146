"""The interface of a proposer that works from token ids alone, in the scheduler.

Two kinds of proposers exist, split by what they need:

* id-only (`TokenProposer`, here): prompt lookup (ngram.py) and suffix decoding (suffix.py)
  read the request's tokens, so they run in the torch-free scheduler, which then knows k
  before it budgets 1 + k tokens and allocates their slots.
* tensor-side (`engine.worker.spec.proposer.WorkerProposer`): a draft model, and heads
  such as EAGLE or MTP that read the target's hidden states, run in the worker after the
  verify step and hand their ids back in `RunnerOutput.draft_token_ids`; the scheduler
  schedules them the next step like any other proposal, so they plug in without a change
  here.
"""

from __future__ import annotations

from typing import Protocol

from engine.core.request import Request
from engine.core.spec.state import SpecState


class TokenProposer(Protocol):
    def propose(self, request: Request, state: SpecState, k: int) -> list[int]:
        """Up to `k` tokens to follow `request.all_token_ids` (fewer or none when the
        proposer has no good guess). Called once per decode step, so per-request work
        must be O(new tokens) plus a bounded lookup."""
        ...

    def on_finished(self, request: Request) -> None:
        """The request finished normally: a proposer may learn from its output."""
        ...


def continuation(tokens: list[int], start: int, k: int) -> list[int]:
    """`k` tokens from `tokens[start:]`; past the end the run repeats itself: a match that
    ends `p` tokens before the end predicts the sequence continues with period `p`."""
    n = len(tokens)
    out = tokens[start : start + k]
    while len(out) < k:
        out.append(out[start + len(out) - n])
    return out
