"""Engine-wide speculation counters (vLLM's `vllm:spec_decode_*` metrics read these)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative since start. A *draft* is one request's proposals in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts whose proposal at position i was accepted.
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < num_proposed:
            per_pos.extend([0] * (num_proposed - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_pos),
        )

    @property
    def mean_acceptance_length(self) -> float | None:
        if not self.num_drafts:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate(self) -> float | None:
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens
