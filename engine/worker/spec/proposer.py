"""The interface of a proposer that runs in the worker, after a step's verification.

A worker-side proposer sees the step as the target computed it (its inputs and last hidden
states) and as it came out (each request's tokens after the accepted ones were appended,
and how many of the step's positions stand), and proposes the next step's tokens for the
requests the scheduler named (`SchedulerOutput.num_lookahead_tokens`). Its ids go back in
`RunnerOutput.draft_token_ids`; the scheduler schedules them like any other proposal.

`DraftModelProposer` (draft_model.py) runs a smaller model with its own paged KV in the
target's blocks. An EAGLE or MTP head would read `ProposeContext.hidden` the same way; a
proposer that samples from a distribution q returns it from `draft_probs` so verification
can apply the rejection rule (otherwise it compares samples, which is exact for any
proposer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.core.step_io import RunnerOutput, SchedulerOutput
from engine.worker.input_batch import CachedRequestState, StepInputs


@dataclass
class ProposeContext:
    inputs: StepInputs
    # The target's last hidden states of the step's tokens, [T, H] (rows as in inputs).
    hidden: torch.Tensor
    # Per-request state after the step: token ids include the tokens accepted in it.
    states: dict[str, CachedRequestState]
    # Request -> its step's first position, and how many of its scheduled positions have
    # K/V that stand (the last known token and the accepted proposals; a whole chunk).
    starts: dict[str, int]
    num_valid: dict[str, int]
    # Request -> tokens to propose for its next step (the scheduler allocated their slots).
    lookahead: dict[str, int]


class WorkerProposer(ABC):
    # Bytes one KV block costs the proposer (its own cache in the target's block ids), which
    # KV sizing adds to the target's.
    kv_bytes_per_block: int = 0

    def allocate_kv_cache(self, num_blocks: int) -> None:  # noqa: B027 - optional
        """Allocates the proposer's cache for the target's `num_blocks` block ids."""

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:  # noqa: B027
        """Copy-on-write of the target's blocks: copy the proposer's blocks along."""

    @abstractmethod
    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        """The next step's proposals, for requests in `ctx.lookahead` (and any other it
        can see need none)."""

    def draft_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None:
        """q of `drafts` ([len(drafts), V]) when they are the proposer's own sampled
        proposals for the request, else None (verification then compares samples)."""
        return None

    def drop(self, request_ids) -> None:  # noqa: B027
        """Forgets requests that left the batch."""


def propose_after_step(
    proposer: WorkerProposer,
    so: SchedulerOutput,
    inputs: StepInputs,
    hidden: torch.Tensor,
    states: dict[str, CachedRequestState],
    out: RunnerOutput,
) -> None:
    """Runs `proposer` after a verified step (rank 0, after sampling); its proposals for
    requests that got tokens join `out.draft_token_ids` (not over a grammar's forced ones).
    A verified request's positions that stand: as many as the tokens it got (the scheduler
    takes back the rest, see `Scheduler._settle_speculation`)."""
    sampled = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
    spec = so.spec_token_ids
    num_valid = {
        rid: len(sampled.get(rid, ())) if rid in spec else so.num_scheduled_tokens[rid]
        for rid in inputs.req_ids
    }
    starts = {rid: states[rid].num_computed_tokens for rid in inputs.req_ids}
    ctx = ProposeContext(inputs, hidden, states, starts, num_valid, so.num_lookahead_tokens)
    for rid, ids in proposer.propose(ctx).items():
        if ids and rid in sampled:
            out.draft_token_ids.setdefault(rid, ids)
