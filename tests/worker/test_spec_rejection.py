"""The rejection rule keeps the target distribution; the mutation that skips its resampling
step (emitting from p instead of the residual max(p - q, 0) after a rejection) does not.

Fixed p and q over 8 tokens, 4,000 independent drafts of one proposal each, fixed seeds.
Goodness of fit of the first emitted token to p, chi-square with 7 degrees of freedom at
significance 0.001 (critical value 24.32). Power against the mutation: it emits
p' = min(p, q) + (1 - sum min(p, q)) p, so the statistic is noncentral chi-square with
lambda = N * sum (p' - p)^2 / p = 4,000 * 0.135 = 540 (mean 547, sd 47): power > 1 - 1e-20.
"""

from __future__ import annotations

import pytest
import torch

from engine.worker.spec import rejection
from engine.worker.spec.verify import RowGroup, accept_chain

P = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
Q = torch.tensor([0.05, 0.05, 0.1, 0.1, 0.2, 0.2, 0.15, 0.15])
N = 4000
CRITICAL_7_DOF_0_001 = 24.32


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness of fit; the p-value from the regularized upper incomplete gamma."""
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(observed.numel() - 1))
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def _first_tokens(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(Q, N, replacement=True, generator=gen).view(N, 1)
    target = P.expand(N, 2, 8).clone()
    draft = Q.expand(N, 1, 8).clone()
    accept_u = torch.rand(N, 1, generator=gen)
    final_u = torch.rand(N, 8, generator=gen)
    accepted, final = rejection.rejection_sample(
        target, draft, ids, torch.ones(N, dtype=torch.long), accept_u, final_u
    )
    first = torch.where(accepted > 0, ids[:, 0], final)
    assert 0 < int(accepted.sum()) < N  # some accepted, some rejected
    return torch.bincount(first, minlength=8).double()


def test_the_chi_square_helper_agrees_with_its_table():
    # chi2(7) sf(24.32) = 0.001
    expected = torch.full((8,), 100.0)
    observed = expected.clone()
    observed[0] += (24.32 * 100 / 2) ** 0.5
    observed[1] -= (24.32 * 100 / 2) ** 0.5
    assert chi_square_p_value(observed, expected) == pytest.approx(0.001, rel=0.01)


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampling_emits_the_target_distribution(seed):
    counts = _first_tokens(seed)
    assert chi_square_p_value(counts, N * P.double()) > 0.001


def test_skipping_the_resampling_step_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    counts = _first_tokens(0)
    assert chi_square_p_value(counts, N * P.double()) < 1e-6


def test_all_accepted_draws_the_bonus_from_p_and_a_padded_request_stops_at_its_count():
    target = torch.zeros(2, 3, 4)
    target[:, :, 1] = 1.0  # p is one-hot at token 1 everywhere
    draft = torch.zeros(2, 2, 4)
    draft[0, :, 1] = 1.0
    draft[1, 0, 1] = 1.0  # request 1 has one proposal (its row 1 is padding)
    ids = torch.tensor([[1, 1], [1, 0]])
    accepted, final = rejection.rejection_sample(
        target, draft, ids, torch.tensor([2, 1]), torch.rand(2, 2), torch.rand(2, 4)
    )
    assert accepted.tolist() == [2, 1] and final.tolist() == [1, 1]


def test_accept_chain_takes_samples_while_they_match_and_stops_before_a_failed_row():
    group = RowGroup("r", 3, [5, 6, 7])
    sampled = [0, 0, 0, 5, 6, 9, 4]
    assert accept_chain(sampled, group, {}) == ([5, 6, 9], None)
    assert accept_chain([0, 0, 0, 5, 6, 7, 4], group, {}) == ([5, 6, 7, 4], None)
    assert accept_chain(sampled, group, {5: "empty"}) == ([5, 6], None)  # met again next step
    assert accept_chain(sampled, group, {3: "empty"}) == ([], "empty")
