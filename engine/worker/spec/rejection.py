"""The rejection rule of speculative sampling, vectorized over a batch of requests.

A proposal d drawn from the draft's distribution q is accepted with probability
min(1, p(d) / q(d)), p the target's distribution at that position (after every mask,
penalty, temperature and truncation); the first rejected position emits a token from the
residual max(p - q, 0), normalized; when all k are accepted the position after them emits
a token from p. The emitted tokens are then distributed exactly as the target's own
samples (Leviathan et al. 2023, Chen et al. 2023).

Shapes: R requests, K = the most proposals any of them has, V the vocabulary. Requests
with fewer proposals are padded (their q rows past their count are zeros, so the residual
at the bonus position is p itself).
"""

from __future__ import annotations

import torch


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0), normalized per row; p itself where that is all zeros (p <= q
    everywhere means p == q, so a rejection there was impossible)."""
    r = (p - q).clamp_(min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def rejection_sample(
    target: torch.Tensor,  # [R, K + 1, V] p at each verified position
    draft: torch.Tensor,  # [R, K, V] q of each proposal (zeros past a request's count)
    draft_ids: torch.Tensor,  # [R, K] long, proposals (anything past the count)
    num_drafts: torch.Tensor,  # [R] long
    accept_u: torch.Tensor,  # [R, K] uniforms for the accept tests
    final_u: torch.Tensor,  # [R, V] uniforms for the emitted token's draw
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted proposals per request [R], the token emitted after them [R])."""
    R, K = draft_ids.shape
    device = target.device
    if K:
        pd = target[:, :K].gather(2, draft_ids.unsqueeze(2)).squeeze(2)
        qd = draft.gather(2, draft_ids.unsqueeze(2)).squeeze(2)
        ok = accept_u * qd <= pd  # u < p / q, without dividing by a zero q
        ok &= torch.arange(K, device=device).unsqueeze(0) < num_drafts.unsqueeze(1)
        accepted = ok.long().cumprod(dim=1).sum(dim=1)
    else:
        accepted = torch.zeros(R, dtype=torch.long, device=device)
    rows = torch.arange(R, device=device)
    p_final = target[rows, accepted]
    q_ext = torch.cat([draft, draft.new_zeros(R, 1, draft.shape[2])], dim=1)
    dist = residual_distribution(p_final, q_ext[rows, accepted])
    q = final_u.log().neg_().clamp_(min=torch.finfo(final_u.dtype).tiny)
    return accepted, (dist / q).argmax(dim=-1)
