"""What speculation keeps per request, on the `Request` (so it lives and dies with it)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.spec.token_index import TokenIndex


@dataclass(slots=True)
class SpecState:
    # The id-only proposer's index over the request's own tokens (n-gram or suffix).
    index: TokenIndex | None = None
    # Proposals a worker-side proposer (draft model, grammar) made for the next step.
    pending: list[int] | None = None
    # Acceptance counts with exponential decay (see adaptive.py): accepted proposals and
    # proposals that were judged (the accepted ones plus the first rejected one).
    hits: float = 0.0
    trials: float = 0.0
    # Totals for the request's metrics and trace span.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify step: 1 + accepted / drafts (vLLM's definition); None if none."""
        if not self.num_drafts:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts
