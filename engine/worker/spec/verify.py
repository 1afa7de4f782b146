"""From the logits of a step's verified positions to each request's accepted tokens.

A request verifying proposals d0..dk-1 has k + 1 consecutive sample rows; row j predicts
the position after d(j-1) (row 0: after its last known token). Each row is an ordinary
sampler row as of its position: penalties count the tokens before it (proposals included),
min_tokens counts the outputs before it, the grammar mask is the one after d0..dj-1, and a
seeded request's randomness is `position_seed(seed, output position)`.

Two rules turn the rows into tokens:

* `accept_chain` (greedy, and every proposal that is not a sampled draft-model token): each
  row's own sample t_j is what the request would have drawn there without speculation;
  d_j is accepted while t_j == d_j, and the tokens are t_0..t_a (a accepted proposals and
  the first differing sample, or the one after the last proposal). The output is the one
  without speculation, token for token, for any seed; for a proposal chosen without looking
  at the row's randomness it is the rejection rule with a one-hot q.
* `rejection.rejection_sample` (a draft model's proposals sampled from its distribution q):
  exact in distribution, and accepts more than comparing samples would.

A row whose masks leave no token ends the chain before it: at row 0 the request fails as
it would without speculation; later, the tokens before it are emitted and the request meets
that row again, alone, in its next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.step_io import TokenLogprobs
from engine.worker.input_batch import CachedRequestState
from engine.worker.sampler import (
    SamplingRow,
    position_seed,
    sampled_logprobs,
    target_distributions,
)
from engine.worker.spec.rejection import rejection_sample


@dataclass
class RowGroup:
    """One request's consecutive sample rows: the first, and the proposals they verify."""

    req_id: str
    first: int
    drafts: list[int]

    @property
    def num_rows(self) -> int:
        return 1 + len(self.drafts)


def row_groups(sample_req_ids: Sequence[str], spec_rows: dict[str, tuple[int, list[int]]]):
    """The step's requests in sample-row order, each with its rows."""
    groups: list[RowGroup] = []
    i, n = 0, len(sample_req_ids)
    while i < n:
        rid = sample_req_ids[i]
        spec = spec_rows.get(rid) if spec_rows else None
        drafts = spec[1] if spec is not None else []
        groups.append(RowGroup(rid, i, drafts))
        i += 1 + len(drafts)
    return groups


def accept_chain(
    sampled: Sequence[int], group: RowGroup, failed: dict[int, str]
) -> tuple[list[int], str | None]:
    """(emitted tokens, why the request fails or None); see the module docstring."""
    out: list[int] = []
    drafts = group.drafts
    for j in range(len(drafts) + 1):
        row = group.first + j
        if row in failed:
            return out, (failed[row] if not out else None)
        tok = sampled[row]
        out.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            break
    return out, None


def rejection_chains(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    bitmask,
    groups: list[RowGroup],
    draft_probs: list[torch.Tensor],
    uniforms: tuple[torch.Tensor, torch.Tensor],
) -> list[tuple[list[int], str | None, list[TokenLogprobs | None]]]:
    """The rejection rule for `groups` (their proposals drawn from `draft_probs[i]`,
    [k_i, V]); `uniforms`: ([G, K] accept tests, [G, V] final draws). Per group: (emitted
    tokens, failure or None, logprobs of the emitted tokens per row)."""
    idx = [g.first + j for g in groups for j in range(g.num_rows)]
    sub_rows = [rows[i] for i in idx]
    index = torch.tensor(idx, device=logits.device)
    sub_logits = logits.index_select(0, index)
    sub_mask = bitmask[idx] if bitmask is not None else None
    probs, failed_sub = target_distributions(sub_logits, sub_rows, sub_mask)
    G = len(groups)
    K = max(len(g.drafts) for g in groups)
    V = probs.shape[1]
    target = probs.new_zeros(G, K + 1, V)
    draft = probs.new_zeros(G, K, V)
    ids = torch.zeros(G, K, dtype=torch.long, device=probs.device)
    offset = 0
    for i, g in enumerate(groups):
        k = len(g.drafts)
        target[i, : k + 1] = probs[offset : offset + k + 1]
        draft[i, :k] = draft_probs[i][:k].to(probs.device, probs.dtype)
        ids[i, :k] = torch.tensor(g.drafts, device=probs.device)
        offset += k + 1
    num = torch.tensor([len(g.drafts) for g in groups], device=probs.device)
    accepted, final = rejection_sample(target, draft, ids, num, *uniforms)
    results = []
    offset = 0
    for g, a, last in zip(groups, accepted.tolist(), final.tolist(), strict=True):
        tokens = [*g.drafts[:a], last]
        fail = None
        for j in range(len(tokens)):
            if offset + j in failed_sub:
                fail = failed_sub[offset + j] if j == 0 else None
                tokens = tokens[:j]
                break
        local = [offset + j for j in range(len(tokens))]
        lps = (
            sampled_logprobs(sub_logits[local], [sub_rows[r] for r in local], tokens)
            if tokens
            else []
        )
        results.append((tokens, fail, lps))
        offset += g.num_rows
    return results


def draft_rejection(
    proposer,
    groups: list[RowGroup],
    states: list[CachedRequestState],
    logits: torch.Tensor,
    rows: list[SamplingRow],
    bitmask,
) -> dict[str, tuple[list[int], str | None, list[TokenLogprobs | None]]]:
    """The rejection rule for the sampled requests whose proposals `proposer` (a
    `WorkerProposer`) drew from its own distribution; request id -> (tokens, failure,
    logprobs). Every other request compares samples (`accept_chain`)."""
    picked, qs = [], []
    for g, st in zip(groups, states, strict=True):
        if g.drafts and not st.params.greedy:
            q = proposer.draft_probs(g.req_id, g.drafts)
            if q is not None:
                picked.append((g, st))
                qs.append(q)
    if not picked:
        return {}
    uniforms = _rejection_uniforms(picked, logits.shape[1], logits.device)
    found = rejection_chains(logits, rows, bitmask, [g for g, _ in picked], qs, uniforms)
    return {g.req_id: res for (g, _), res in zip(picked, found, strict=True)}


def _rejection_uniforms(picked, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[G, K] accept-test and [G, V] final-draw uniforms; a seeded request's drawn from
    (seed, output position), so its run is reproducible."""
    K = max(len(g.drafts) for g, _ in picked)
    accept = torch.rand(len(picked), K, device=device)
    final = torch.rand(len(picked), vocab, device=device)
    for i, (g, st) in enumerate(picked):
        seed = st.params.seed
        if seed is None:
            continue
        gen, first = st.generator, len(st.token_ids) - st.num_prompt_tokens
        for j in range(len(g.drafts)):
            gen.manual_seed(position_seed(seed, first + j, stream=2))
            accept[i, j : j + 1].uniform_(generator=gen)
        gen.manual_seed(position_seed(seed, first, stream=3))
        final[i].uniform_(generator=gen)
    return accept, final
