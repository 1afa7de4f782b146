"""Turns one step's logits into token ids, vectorized over the batch.

The runner hands over a `[N, V]` float32 logits matrix and one `SamplingRow` per row. The
per-row parameters are gathered into small `[N]` tensors once per step; all the math is
batched. Order of operations (the same as vLLM v1, so results are comparable)::

    raw logits ──▶ logprobs (log_softmax of the RAW logits, only if a row asks)
        │
        ├─ grammar bitmask (structured outputs), allowed_token_ids mask,
        │  min_tokens stop-token mask, logit_bias
        ├─ repetition / frequency / presence penalties
        ├─ a row left without any token fails (`SamplerOutput.failed`), never samples one
        ├─ greedy rows: argmax here (temperature and truncation cannot change it)
        ├─ temperature ─▶ min-p ─▶ top-k ─▶ top-p
        └─ sample: argmax(probs / q), q ~ Exp(1) drawn per seeded row from its own generator

A step where every row is greedy and nothing edits the logits is a plain argmax.

Seeds: a seeded row's randomness is drawn from its generator reseeded with
`position_seed(seed, output position)`, so a seeded request's token at each position
depends on its seed, the position and its logits only: the same with or without
speculative decoding (which samples several positions of one request in one step), after
a preemption, and whatever else shares the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.core.step_io import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.worker.kernels import fused
from engine.worker.structured.bitmask import apply_bitmask

# Prompt logprobs are computed in row chunks so a long prefill chunk never materializes a
# full [P, V] logits matrix: the runner computes logits this many rows at a time.
PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class SamplingRow:
    """One row of the logits matrix: what the sampler needs to know about its request."""

    params: SamplingParams
    # Prompt then output token ids, read only by penalties: the runner passes its own list
    # (no copy) when `params.needs_penalties`, else nothing, so a step costs no O(length).
    token_ids: Sequence[int]
    num_prompt_tokens: int
    # Generated so far (for min_tokens); always set.
    num_output_tokens: int
    # Per-request generator, from `make_generator(params.seed, device)`; None when unseeded.
    generator: torch.Generator | None = None
    # EOS ids suppressed (with params.stop_token_ids) while fewer than params.min_tokens
    # tokens have been generated. Empty: only params.stop_token_ids are suppressed.
    eos_token_ids: Sequence[int] = ()
    # True when the step's grammar bitmask has a row for this request (structured outputs
    # with its grammar active): the sampler masks what the grammar forbids.
    grammar: bool = False
    # The generator is reseeded with this right before the row's draw
    # (`position_seed(params.seed, output position)`); None: draw from it as it stands.
    position_seed: int | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]  # -1 for a failed row
    # Parallel to token_ids; None for rows whose params.logprobs is None (or failed).
    logprobs: list[TokenLogprobs | None]
    # Row -> why it has no token: its masks together exclude every token. Such a row is
    # never given a token outside them (no fallback to token 0); its request must end.
    failed: dict[int, str] = field(default_factory=dict)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded for one request, or None when the request has no seed.

    Seeds are taken modulo 2**64 so any Python int (negative or huge) is accepted.
    """
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit ints that scatters nearby inputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int, stream: int = 0) -> int:
    """The generator seed of a seeded request's sample at output `position` (`stream` tells
    apart several draws at one position, e.g. a draft model's and a rejection test's)."""
    return _mix64((seed & _MASK64) ^ _mix64((position << 8 | stream) + 0x9E3779B97F4A7C15))


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of [N, V]; first index on ties, NaN counts as the maximum.

    On the CPU NumPy's argmax is ~6x faster than torch's at LM-head widths (0.65 vs 4.1 ms
    for 64 x 49,152 fp32 here) and has the same tie and NaN rules."""
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[1]:
        if x.dtype == torch.float32:
            return torch.from_numpy(x.contiguous().numpy().argmax(axis=-1))
        if x.dtype == torch.bfloat16 and fused.usable(x):  # in place, no fp32 copy
            return fused.argmax_rows_bf16(x if x.stride(1) == 1 else x.contiguous())
    return x.argmax(dim=-1)


class Sampler:
    """Stateless: everything a step needs comes in with the rows."""

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        grammar_bitmask: np.ndarray | None = None,
    ) -> SamplerOutput:
        """Samples one token per row of `logits` ([N, V]) and, where asked, its logprobs.

        `grammar_bitmask`: [N, ceil(V / 32)] int32 (`engine.worker.structured.bitmask`),
        read for the rows whose `grammar` is set."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [len(rows), V]; got {tuple(logits.shape)} for {len(rows)} rows"
            )
        if not rows:
            return SamplerOutput([], [])
        failed: dict[int, str] = {}
        if is_plain_greedy(rows):  # a bf16 model's logits may come as they are (see below)
            token_ids = row_argmax(logits)
            if any(r.params.logprobs is not None for r in rows):
                logits = logits.float()
        else:
            logits = logits.float()
            token_ids, failed = _sample(logits, rows, grammar_bitmask)
        out = SamplerOutput(token_ids.tolist(), _sampled_logprobs(logits, rows, token_ids), failed)
        for i in failed:
            out.token_ids[i], out.logprobs[i] = -1, None
        return out


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> list[TokenLogprobs]:
    """Logprobs of `target_ids[i]` under `logits[i]` (the raw model distribution).

    logits: [P, V] at prompt positions; target_ids: [P], the next prompt token of each.
    """
    if logits.shape[0] != target_ids.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows for {target_ids.shape[0]} targets")
    out: list[TokenLogprobs] = []
    for start in range(0, logits.shape[0], PROMPT_LOGPROBS_CHUNK):
        end = start + PROMPT_LOGPROBS_CHUNK
        lp = torch.log_softmax(logits[start:end].float(), dim=-1)
        targets = target_ids[start:end].to(device=lp.device, dtype=torch.long)
        out.extend(_token_logprobs(lp, targets, [num_top] * lp.shape[0]))
    return out


# ---- which work a step needs ----------------------------------------------------------------


def _suppresses_stop_tokens(row: SamplingRow) -> bool:
    p = row.params
    return row.num_output_tokens < p.min_tokens and bool(p.stop_token_ids or row.eos_token_ids)


def _edits_logits(row: SamplingRow) -> bool:
    p = row.params
    return (
        row.grammar
        or bool(p.logit_bias)
        or p.allowed_token_ids is not None
        or p.needs_penalties
        or _suppresses_stop_tokens(row)
    )


def is_plain_greedy(rows: list[SamplingRow]) -> bool:
    """Every row greedy with nothing that edits its logits: its token is the plain argmax."""
    return all(r.params.greedy and not _edits_logits(r) for r in rows)


# ---- the sampling path ------------------------------------------------------------------------


def _sample(
    logits: torch.Tensor, rows: list[SamplingRow], grammar_bitmask: np.ndarray | None = None
) -> tuple[torch.Tensor, dict[int, str]]:
    """Token ids [N] for a batch that needs more than a plain argmax, and the rows whose
    masks left no token (their ids are meaningless)."""
    logits = logits.clone()  # the raw logits stay intact for logprobs
    failed = _apply_masks(logits, rows, grammar_bitmask)
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        return row_argmax(logits), failed
    greedy_ids = row_argmax(logits) if any(greedy) else None
    _apply_temperature_and_truncation(logits, rows, greedy)
    sampled = _exponential_race(torch.softmax(logits, dim=-1), rows, greedy)
    if greedy_ids is not None:
        sampled = torch.where(torch.tensor(greedy, device=logits.device), greedy_ids, sampled)
    return sampled, failed


def target_distributions(
    logits: torch.Tensor, rows: list[SamplingRow], grammar_bitmask: np.ndarray | None = None
) -> tuple[torch.Tensor, dict[int, str]]:
    """The distribution each row samples from, [N, V] float32 (one-hot at the argmax for a
    greedy row), after every mask, penalty, temperature and truncation, and the rows whose
    masks left no token. What speculative decoding's rejection rule compares a draft
    model's proposal distribution against."""
    logits = logits.float().clone()
    failed = _apply_masks(logits, rows, grammar_bitmask)
    greedy = [r.params.greedy for r in rows]
    _apply_temperature_and_truncation(logits, rows, greedy)
    probs = torch.softmax(logits, dim=-1)
    if any(greedy):
        idx = [i for i, g in enumerate(greedy) if g]
        rows_t = torch.tensor(idx, device=logits.device)
        hot = torch.zeros(len(idx), logits.shape[1], device=logits.device)
        hot.scatter_(1, row_argmax(logits[rows_t]).unsqueeze(1).to(logits.device), 1.0)
        probs[rows_t] = hot
    return probs, failed


def sampled_logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], token_ids: list[int]
) -> list[TokenLogprobs | None]:
    """Logprobs of the given tokens under the RAW logits, for the rows that ask for them."""
    ids = torch.tensor(token_ids, device=logits.device, dtype=torch.long)
    return _sampled_logprobs(logits.float(), rows, ids)


def _apply_masks(
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


def _apply_temperature_and_truncation(
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
        if r.grammar or r.params.allowed_token_ids is not None or _suppresses_stop_tokens(r)
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
    if _suppresses_stop_tokens(row):
        masks.append(f"min_tokens={p.min_tokens} (stop and EOS ids masked)")
    if p.logit_bias:
        masks.append("logit_bias")
    return f"no token can be sampled: {' with '.join(masks)} exclude every token"


def _exponential_race(
    probs: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]
) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exp(1) is a draw from `probs` (the Gumbel-max trick).

    A seeded row draws its q from its own generator, so its token depends only on its seed,
    its step count and its own logits, never on which other requests share the batch.
    Unseeded rows share one batch draw from the global generator. q = -log(u), u ~ U[0, 1),
    is several times cheaper than `exponential_` on CPU.
    """
    u = torch.empty_like(probs)
    seeded = [
        (i, r)
        for i, (r, g) in enumerate(zip(rows, greedy, strict=True))
        if r.generator is not None and not g
    ]
    if len(seeded) < len(rows):
        u.uniform_()
    for i, r in seeded:
        if r.position_seed is not None:
            r.generator.manual_seed(r.position_seed)
        u[i].uniform_(generator=r.generator)
    # Clamped so q is never 0: 0/0 would be NaN, which argmax treats as the maximum.
    q = u.log_().neg_().clamp_(min=torch.finfo(u.dtype).tiny)
    return row_argmax(probs.div_(q))


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
        if _suppresses_stop_tokens(r)
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


# ---- logprobs -------------------------------------------------------------------------------


def _sampled_logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor
) -> list[TokenLogprobs | None]:
    """Logprobs of the sampled tokens under the RAW logits, for rows that asked."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not want:
        return out
    idx = torch.tensor(want, device=logits.device)
    lp = torch.log_softmax(logits[idx], dim=-1)
    entries = _token_logprobs(lp, token_ids[idx], [rows[i].params.logprobs or 0 for i in want])
    for i, entry in zip(want, entries, strict=True):
        out[i] = entry
    return out


def _token_logprobs(
    lp: torch.Tensor, chosen: torch.Tensor, num_top: list[int]
) -> list[TokenLogprobs]:
    """One `TokenLogprobs` per row of `lp` ([M, V] log-probabilities).

    rank is 1 + the number of tokens strictly more likely than the chosen one.
    """
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen_lp.unsqueeze(1)).sum(dim=-1) + 1
    k = min(max(num_top, default=0), lp.shape[1])
    if k > 0:
        top_v, top_i = lp.topk(k, dim=-1)
        top_vals, top_ids = top_v.tolist(), top_i.tolist()
    else:
        top_vals = top_ids = [[] for _ in num_top]
    return [
        TokenLogprobs(tok, val, rank, list(zip(ids[:n], vals[:n], strict=True)))
        for tok, val, rank, ids, vals, n in zip(
            chosen.tolist(),
            chosen_lp.tolist(),
            ranks.tolist(),
            top_ids,
            top_vals,
            num_top,
            strict=True,
        )
    ]
