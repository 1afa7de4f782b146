"""The batch's token bitmask: filled by llguidance per step, applied to the logits.

Shapes: logits [N, V] float32; bitmask [N, W] int32 with W = ceil(V / 32), bit j of word w
set when token 32 * w + j is allowed (llguidance's layout). Rows without an active grammar
are never read. Filling runs llguidance's `LLExecutor` over the constrained rows in one call
(its threads, the GIL dropped); applying unpacks the bits with NumPy and masks in one
`masked_fill_` over the constrained rows only.

EOS: llguidance knows one EOS id and allows it exactly when the grammar accepts; the
model's other EOS ids (e.g. `<|im_end|>` from generation_config.json) get the same verdict.
Padded vocabulary ids (V above the tokenizer's length) decode to nothing and are never
allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance as llg
import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(
    executor: llg.LLExecutor,
    matchers: Sequence[tuple[int, llg.LLMatcher]],
    num_rows: int,
    vocab_size: int,
    llg_eos: int,
    eos_token_ids: Sequence[int],
    drafts: Sequence[Sequence[int]] | None = None,
) -> np.ndarray:
    """[num_rows, W] int32: each (row, matcher)'s allowed tokens in its row; other rows
    all ones (they are not applied). `drafts` (speculative decoding, parallel to
    `matchers`): row + 1 + j gets the mask after the matcher took drafts[0..j] (llguidance
    advances a copy of the state and rolls it back; rows past a refused draft stay ones)."""
    words = bitmask_words(vocab_size)
    mask = np.full((num_rows, words), -1, dtype=np.int32)
    if matchers:
        drafts = drafts if drafts is not None else [()] * len(matchers)
        pairs = [(m, r) for (r, m), d in zip(matchers, drafts, strict=True) if not d]
        triples = [(m, r, list(d)) for (r, m), d in zip(matchers, drafts, strict=True) if d]
        if pairs:
            executor.unsafe_compute_mask_ptr(pairs, mask.ctypes.data, words * 4, num_rows)
        if triples:
            executor.unsafe_compute_mask_ptr_with_draft_token(
                triples, mask.ctypes.data, words * 4, num_rows
            )
        row_ids = [r + j for (r, _), d in zip(matchers, drafts, strict=True)
                   for j in range(len(d) + 1)]  # fmt: skip
        others = [t for t in eos_token_ids if t != llg_eos and t < vocab_size]
        if others:
            rows = np.asarray(row_ids, dtype=np.int64)
            u = mask.view(np.uint32)
            accepting = (u[rows, llg_eos // 32] >> np.uint32(llg_eos % 32)) & np.uint32(1)
            for t in others:
                bit = np.uint32(1 << (t % 32))
                col = u[rows, t // 32]
                u[rows, t // 32] = np.where(accepting == 1, col | bit, col & ~bit)
    return mask


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: Sequence[int]) -> None:
    """Sets to -inf every logit of `rows` whose bit is clear, in place."""
    if not rows:
        return
    vocab = logits.shape[1]
    idx = np.asarray(rows, dtype=np.int64)
    bits = np.unpackbits(bitmask[idx].view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    blocked = torch.from_numpy(bits == 0).to(logits.device)
    if vocab > bits.shape[1]:  # logits wider than the mask: the extra ids are padding
        pad = torch.ones(len(rows), vocab - bits.shape[1], dtype=torch.bool)
        blocked = torch.cat([blocked, pad.to(logits.device)], dim=1)
    row_t = torch.from_numpy(idx).to(logits.device)
    logits[row_t] = logits[row_t].masked_fill_(blocked, float("-inf"))
