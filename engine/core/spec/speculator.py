"""The scheduler's one speculation object: k and the proposal per request, and the outcome.

Per step the scheduler calls `begin_step` once, then for each decoding request `propose`
(the tokens to schedule after its last one) and, for a worker-side proposer, `lookahead`
(how many tokens the worker should propose after the step, whose KV slots are allocated
with the step's); `settle` records each verification, `take_worker_proposals` keeps the
ids a worker-side proposer returned, `on_finished` lets a proposer learn from a finished
request. Everything here is O(1) per request plus the proposer's bounded lookup.
"""

from __future__ import annotations

from engine.config import SpeculativeConfig
from engine.core.request import Request
from engine.core.spec import adaptive
from engine.core.spec.ngram import NgramProposer
from engine.core.spec.proposer import TokenProposer
from engine.core.spec.state import SpecState
from engine.core.spec.stats import SpecDecodeStats
from engine.core.spec.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig) -> TokenProposer | None:
    """The id-only proposer of `config.method`; None for a worker-side one (draft)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config)
    return None


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: TokenProposer | None = None):
        """`proposer`: overrides the method's id-only proposer (tests use stubs)."""
        self.config = config
        self.k_max = config.num_speculative_tokens
        self.proposer = proposer if proposer is not None else make_proposer(config)
        # A worker-side proposer needs KV slots for what it proposes (a draft model).
        self.worker_side_kv = config.method == "draft"
        self.stats = SpecDecodeStats()
        self._step = adaptive.StepCost(0, config.step_fixed_cost_tokens)
        self._off = False  # this step: over disable_by_batch_size

    def begin_step(self, num_running: int) -> None:
        cap = self.config.disable_by_batch_size
        self._off = cap is not None and num_running > cap
        self._step = adaptive.StepCost(num_running, self.config.step_fixed_cost_tokens)

    def propose(self, req: Request, max_k: int) -> list[int]:
        """The tokens `req` proposes this step (at most `max_k`: what the token budget, the
        model length and its max_tokens leave), possibly none."""
        st = req.spec
        if st is None:
            st = req.spec = SpecState()
        pending, st.pending = st.pending, None
        if self._off or max_k <= 0:
            return []
        if pending is not None:
            accept = adaptive.acceptance(st)
            k = self._choose(accept, min(max_k, len(pending)))
            draft = pending[:k]
        elif self.proposer is not None:
            accept = adaptive.acceptance(st)
            k = self._choose(accept, max_k)
            draft = self.proposer.propose(req, st, k) if k else []
        else:
            return []
        if draft:
            self._step.take(accept, len(draft))
        return draft

    def _choose(self, accept: float, k_max: int) -> int:
        k_max = min(k_max, self.k_max)
        if not self.config.adaptive:
            return k_max
        return self._step.best_k(accept, k_max)

    def lookahead(self, req: Request) -> int:
        """Tokens a worker-side proposer should propose for `req`'s next step (0 when the
        method has none that needs KV): the rule's k for it as of now."""
        if not self.worker_side_kv or self._off:
            return 0
        st = req.spec
        accept = adaptive.acceptance(st) if st is not None else 0.5
        return self._choose(accept, self.k_max)

    def settle(self, req: Request, num_proposed: int, num_emitted: int) -> None:
        """`req` verified `num_proposed` proposals and got `num_emitted` tokens back (the
        accepted proposals plus the token after them)."""
        accepted = min(max(num_emitted - 1, 0), num_proposed)
        st = req.spec
        if st is None:
            st = req.spec = SpecState()
        adaptive.record(st, num_proposed, accepted)
        st.num_drafts += 1
        st.num_draft_tokens += num_proposed
        st.num_accepted_tokens += accepted
        self.stats.record(num_proposed, accepted)

    def take_worker_proposals(
        self, requests: dict[str, Request], proposals: dict[str, list[int]]
    ) -> None:
        """Keeps each request's worker-side proposals for its next step (they replace the
        id-only proposer's for that step: a grammar's forced tokens are sure to be accepted,
        and are judged by the same acceptance estimate, which they soon raise)."""
        for rid, ids in proposals.items():
            req = requests.get(rid)
            if req is None or req.is_finished or not ids:
                continue
            st = req.spec
            if st is None:
                st = req.spec = SpecState()
            st.pending = ids

    def on_finished(self, req: Request) -> None:
        if self.proposer is not None:
            self.proposer.on_finished(req)
