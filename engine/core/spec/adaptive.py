"""How many tokens a request proposes this step: its recent acceptance against the batch.

A step's time grows with the tokens it computes, from a fixed part (reading the weights,
launching the work) that a few more tokens barely change. In units of one more token's
compute (`speculative.step_fixed_cost_tokens` = F), a step of N tokens costs F + N; B
decoding requests without speculation yield B tokens for F + B. A request whose proposals
are each accepted with probability a (given the previous ones were) and that proposes k
tokens yields E(k) = 1 + a + ... + a^k tokens for k more of cost.

The rule visits the step's requests in turn, keeping G (tokens the step is expected to
yield) and C (its cost) so far, starting from G = B, C = F + B. A request's (k + 1)-th
proposal is worth taking when it raises G / C: when a^(k+1) x (C + k) > G + E(k) - 1. It
takes the largest such k (at most num_speculative_tokens), then G += E(k) - 1, C += k.

With F = 32 (docs/speculative.md has the measured F for this CPU):

    a     B = 1   B = 8   B = 32   B = 128     (k of the step's first request, k_max 16)
    0.9    16      12      6        2
    0.7    7       4       1        0
    0.5    4       2       0        0
    0.2    2       0       0        0

so an idle server speculates deeply, a saturated one only on runs it keeps accepting, and
not at all on open-ended text. `a` is estimated per request from its last verifications:
accepted proposals and judged proposals (accepted + the first rejected one), each decayed
by `DECAY` per verification, plus a prior worth `PRIOR_TRIALS` proposals at rate 1/2, so a
new request starts at a = 0.5, and one whose proposals stop being accepted falls towards
2/9 (from 0.91 after four full acceptances to 0.40 after four rejections).
"""

from __future__ import annotations

from engine.core.spec.state import SpecState

DECAY = 0.6
PRIOR_HITS = 1.0
PRIOR_TRIALS = 2.0


def acceptance(state: SpecState) -> float:
    """The request's estimated per-token acceptance probability."""
    return (state.hits + PRIOR_HITS) / (state.trials + PRIOR_TRIALS)


def record(state: SpecState, num_proposed: int, num_accepted: int) -> None:
    """One verification: `num_accepted` of `num_proposed` proposals were accepted."""
    judged = num_accepted + (1 if num_accepted < num_proposed else 0)
    state.hits = state.hits * DECAY + num_accepted
    state.trials = state.trials * DECAY + judged


class StepCost:
    """The rule's running totals over one step (a per-step context, made by `begin_step`)."""

    __slots__ = ("gain", "cost")

    def __init__(self, num_running: int, fixed_cost: float):
        self.gain = float(num_running)
        self.cost = fixed_cost + num_running

    def best_k(self, accept: float, k_max: int) -> int:
        """The k the rule picks for a request with acceptance `accept` (nothing recorded)."""
        k, expected, p = 0, 1.0, accept
        gain, cost = self.gain, self.cost
        while k < k_max and p * (cost + k) > gain + expected - 1.0:
            k += 1
            expected += p
            p *= accept
        return k

    def take(self, accept: float, k: int) -> None:
        """Adds a request that proposes `k` tokens to the step's totals."""
        expected, p = 1.0, accept
        for _ in range(k):
            expected += p
            p *= accept
        self.gain += expected - 1.0
        self.cost += k
