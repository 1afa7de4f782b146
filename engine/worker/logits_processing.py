"""What the sampler does to a batch's logits before it draws: masks, penalties, truncation.

In the sampler's order (engine/worker/sampler.py draws the pipeline): `apply_masks` applies
a grammar's bitmask, `allowed_token_ids`, the `min_tokens` stop-token mask, `logit_bias` and
the repetition / frequency / presence penalties in place, and returns the rows its masks
left without any token (each with a message naming the masks: such a row must fail, never
sample a token outside them); `apply_temperature_and_truncation` divides by temperature,
then applies min-p, top-k and top-p to the sampled rows. Everything is batched over rows:
per-row parameters become small tensors, ragged token lists one scatter index each.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from engine.worker.sampling_row import SamplingRow
from engine.worker.structured.bitmask import apply_bitmask

__all__ = ["apply_masks", "apply_temperature_and_truncation", "suppresses_stop_tokens"]


def suppresses_stop_tokens(row: SamplingRow) -> bool:
    """min_tokens not reached and the row has stop tokens or EOS ids: they are masked."""
    p = row.params
    return row.num_output_tokens < p.min_tokens and bool(p.stop_token_ids or row.eos_token_ids)


def apply_masks(
    logits: torch.Tensor, rows: list[SamplingRow], grammar_bitmask: np.ndarray | None
) -> dict[int, str]:
    """Grammar, allowed ids, min_tokens, logit bias and penalties, in place; the rows left
    without any token."""
    grammar_rows = [i for i, r in enumerate(rows) if r.grammar]
    if grammar_rows:
        if grammar_bitmask is None:
            raise ValueError("rows marked grammar need a grammar_bitmask")
        apply_bitmask(logits, grammar_bitmask, grammar_rows)
    _apply_allowed_token_ids(logits, rows)
    _apply_min_tokens(logits, rows)
    _apply_logit_bias(logits, rows)
    _apply_penalties(logits, rows)
    return _rows_without_a_token(logits, rows)


def apply_temperature_and_truncation(
    logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]
) -> None:
    """temperature -> min-p -> top-k -> top-p on the sampled rows, in place."""
    device = logits.device
    # Greedy rows get temperature 1 so the division is harmless; their result is replaced.
    temps = [1.0 if g else r.params.temperature for g, r in zip(greedy, rows, strict=True)]
    if any(t != 1.0 for t in temps):
        logits.div_(torch.tensor(temps, device=device, dtype=logits.dtype).unsqueeze(1))

    min_ps = [0.0 if g else r.params.min_p for g, r in zip(greedy, rows, strict=True)]
    if any(m > 0.0 for m in min_ps):
        _apply_min_p(logits, torch.tensor(min_ps, device=device, dtype=logits.dtype))

    vocab = logits.shape[1]
    top_ks = [
        vocab if g or r.params.top_k <= 0 else min(r.params.top_k, vocab)
        for g, r in zip(greedy, rows, strict=True)
    ]
    # top_p >= 1 is disabled exactly: 2.0 can never be reached by a float cumsum.
    top_ps = [
        2.0 if g or r.params.top_p >= 1.0 else r.params.top_p
        for g, r in zip(greedy, rows, strict=True)
    ]
    _apply_top_k_top_p(logits, top_ks, top_ps)


def _rows_without_a_token(logits: torch.Tensor, rows: list[SamplingRow]) -> dict[int, str]:
    """Masked rows in which every logit is -inf, each with a message naming its masks."""
    masked = [
        i
        for i, r in enumerate(rows)
        if r.grammar or r.params.allowed_token_ids is not None or suppresses_stop_tokens(r)
    ]
    if not masked:
        return {}
    idx = torch.tensor(masked, device=logits.device)
    empty = torch.isneginf(logits[idx]).all(dim=-1).tolist()
    return {i: _no_token_message(rows[i]) for i, e in zip(masked, empty, strict=True) if e}


def _no_token_message(row: SamplingRow) -> str:
    p = row.params
    masks = []
    if row.grammar:
        masks.append("the structured_outputs grammar")
    if p.allowed_token_ids is not None:
        masks.append("allowed_token_ids")
    if suppresses_stop_tokens(row):
        masks.append(f"min_tokens={p.min_tokens} (stop and EOS ids masked)")
    if p.logit_bias:
        masks.append("logit_bias")
    return f"no token can be sampled: {' with '.join(masks)} exclude every token"


def _apply_allowed_token_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    allowed = [
        (i, r.params.allowed_token_ids)
        for i, r in enumerate(rows)
        if r.params.allowed_token_ids is not None
    ]
    if not allowed:
        return
    device = logits.device
    rows_with_mask = [i for i, _ in allowed]
    blocked = torch.zeros(logits.shape, dtype=torch.bool, device=device)
    blocked[torch.tensor(rows_with_mask, device=device)] = True
    row_idx, col_idx = _flat_index(rows_with_mask, [ids for _, ids in allowed], device)
    blocked[row_idx, col_idx] = False
    logits.masked_fill_(blocked, float("-inf"))


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """While a row is short of min_tokens, its stop tokens (and EOS) cannot be sampled."""
    hits = [
        (i, list(r.params.stop_token_ids) + list(r.eos_token_ids))
        for i, r in enumerate(rows)
        if suppresses_stop_tokens(r)
    ]
    if not hits:
        return
    row_idx, col_idx = _flat_index([i for i, _ in hits], [ids for _, ids in hits], logits.device)
    logits[row_idx, col_idx] = float("-inf")


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return
    device = logits.device
    row_idx, col_idx = _flat_index([i for i, _ in biased], [list(b) for _, b in biased], device)
    values = torch.tensor([v for _, b in biased for v in b.values()], dtype=logits.dtype)
    logits.index_put_((row_idx, col_idx), values.to(device), accumulate=True)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Penalties on the rows that ask for them, touching only the tokens they have seen.

    repetition (HF/vLLM), first: every token seen in prompt or output has its logit divided
    by the penalty when positive and multiplied by it when not. presence/frequency (OpenAI):
    logit -= presence * [count > 0] + frequency * count, over generated tokens only.
    Work is O(tokens seen), not O(rows x vocab).
    """
    pen = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not pen:
        return
    device, dtype = logits.device, logits.dtype

    # Duplicate (row, token) pairs are harmless below: each write of a gathered-then-
    # transformed value writes the same number, and only the frequency term accumulates.
    rep_rows = [i for i in pen if rows[i].params.repetition_penalty != 1.0]
    if rep_rows:
        r, c = _flat_index(rep_rows, [rows[i].token_ids for i in rep_rows], device)
        rep = _per_row(rows, "repetition_penalty", dtype, device)[r]
        vals = logits[r, c]
        logits[r, c] = torch.where(vals > 0, vals / rep, vals * rep)

    out_rows = [
        i for i in pen if rows[i].params.frequency_penalty or rows[i].params.presence_penalty
    ]
    if out_rows:
        outputs = [rows[i].token_ids[rows[i].num_prompt_tokens :] for i in out_rows]
        r, c = _flat_index(out_rows, outputs, device)
        logits[r, c] = logits[r, c] - _per_row(rows, "presence_penalty", dtype, device)[r]
        freq = _per_row(rows, "frequency_penalty", dtype, device)[r]
        logits.index_put_((r, c), -freq, accumulate=True)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drops tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> None:
    """Keeps the k best tokens, then the smallest prefix of them whose mass reaches p.

    top_ks: per row, V = disabled; top_ps: per row, > 1 = disabled. Only the rows that
    truncate are touched. Rows with a top-k need only their `max k` best candidates
    (`topk`, far cheaper than sorting a 150k vocabulary); rows with only a top-p need the
    full sort. Ties are broken by sort order, so top_k=1 keeps a single token.
    """
    vocab = logits.shape[1]
    with_k = [i for i, k in enumerate(top_ks) if k < vocab]
    p_only = [
        i for i, (k, p) in enumerate(zip(top_ks, top_ps, strict=True)) if k >= vocab and p < 1
    ]
    device, dtype = logits.device, logits.dtype
    for group in (with_k, p_only):
        if not group:
            continue
        idx = torch.tensor(group, device=device)
        sub = logits[idx]
        if group is with_k:
            vals, ids = sub.topk(max(top_ks[i] for i in group), dim=-1)  # best first
            positions = torch.arange(vals.shape[1], device=device).unsqueeze(0)
            k = torch.tensor([top_ks[i] for i in group], device=device).unsqueeze(1)
            vals.masked_fill_(positions >= k, float("-inf"))
        else:
            vals, ids = sub.sort(dim=-1, descending=True)
        ps = [top_ps[i] for i in group]
        if any(p < 1 for p in ps):
            probs = torch.softmax(vals, dim=-1)  # renormalized over the top-k survivors
            mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
            drop = mass_before >= torch.tensor(ps, device=device, dtype=dtype).unsqueeze(1)
            drop[:, 0] = False
            vals.masked_fill_(drop, float("-inf"))
        logits[idx] = torch.full_like(sub, float("-inf")).scatter_(1, ids, vals)


def _per_row(
    rows: list[SamplingRow], name: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[N] tensor of one SamplingParams field, indexed by batch row."""
    return torch.tensor([getattr(r.params, name) for r in rows], dtype=dtype).to(device)


def _flat_index(
    row_ids: list[int], token_lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors on `device` for scattering ragged per-row token lists.

    Built on the CPU from Python lists (two small copies to the device), never per row.
    """
    lengths = torch.tensor([len(t) for t in token_lists])
    rows = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.long), lengths)
    cols = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    return rows.to(device), cols.to(device)
