"""Greedy tokens of an fp32 model without its fp32 logits: a bf16 screen, then an fp32 recheck.

A greedy step needs each row's argmax, not its logits. At W64's 64 rows the fp32 LM head
(49,152 x 512) took 18 ms of a ~60 ms decode step on an AMX Xeon (2 threads), the same GEMM
in bf16 4.4 ms; at one row 3.3 ms against 1.9 (the bf16 weight is half the bytes). So on a
CPU that computes bf16 natively (`cpu_features.native_bf16`) an fp32 model keeps a bf16 copy
of its LM head (half the fp32 head's bytes more in memory, logged at start) and a greedy step:

1. computes the logits in bf16 (`a_j`, fp32 accumulation, rounded to bf16 on output);
2. bounds their error. With u = 2^-8 (bf16's unit roundoff) each product of rounded inputs
   is off by at most (2u + u^2) |x_i w_ji|, the fp32 sums by gamma_K = K 2^-24 / (1 - K
   2^-24) of the same sum (for ours and for the fp32 logits we compare against), and
   sum |x_i w_ji| <= ||x|| ||w_j|| (Cauchy-Schwarz) <= ||x|| max_j ||w_j||. So |a_j - z_j|
   <= A + rel |a_j| with A = (2u + u^2 + 2 gamma_K) ||x|| max_j ||w_j|| (times 1.25 for
   slack) and rel = 2^-8 for the output rounding;
3. keeps every index whose exact logit may still be the largest (`screen_rows_bf16` in
   csrc/fused_ops.c: a_j >= max - (2A + 2 rel |max|) / (1 - rel));
4. recomputes those candidates in fp32 and takes their argmax (the first index on ties,
   as the full path's).

One candidate needs no recheck. A random 50M model has a handful per row (its logits are
near-Gaussian, the top ones close); a trained one mostly one. A row with more than `CAP`,
a NaN or an infinity sends the step to the full fp32 logits (`token_ids` returns None).
The token is the argmax of fp32 logits computed in another order than the full GEMM's, so it
can differ only where two logits tie to the last fp32 bits, as the full path already does
from transformers' (oneDNN against MKL). Only plain greedy rows without logprobs use it
(the runner decides); `runtime.cpu_kernels: false` turns it off with the other kernels.
"""

from __future__ import annotations

import logging

import torch

from engine.worker.kernels import fused
from engine.worker.models.cpu_linear import pack_weight, packed_linear, packing_available

logger = logging.getLogger(__name__)

BF16_UNIT = 2.0**-8  # bf16 keeps 8 significant bits: rounding is off by <= 2^-8 relative
OUTPUT_REL = 2.0**-8  # rounding the fp32 sums to bf16 logits (2^-9, doubled for slack)
SLACK = 1.25
CAP = 128  # candidates per row before the step falls back to the full logits


class GreedyScreen:
    """Argmax rows of hidden @ weight^T for an fp32 weight [V, K], exactly, from a bf16 GEMM.

    `weight` is kept by reference (the model's LM head or tied embedding) for the recheck."""

    def __init__(self, weight: torch.Tensor):
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"the screen takes an fp32 [V, K] weight, not {weight.dtype}")
        self.weight = weight.detach()
        self.vocab, k = self.weight.shape
        self.packed = pack_weight(self.weight.to(torch.bfloat16))
        gamma = k * 2.0**-24 / (1.0 - k * 2.0**-24)
        max_norm = float(self.weight.norm(dim=1).max())
        self._abs_per_norm = (2 * BF16_UNIT + BF16_UNIT**2 + 2 * gamma) * max_norm * SLACK
        self.extra_bytes = self.weight.numel() * 2

    @staticmethod
    def available() -> str | None:
        """None when the screen can run here, else why not (for the start-up log)."""
        from engine.worker.cpu_features import native_bf16

        support = native_bf16()
        if not support.native:
            return f"bf16 is not native here ({support.reason})"
        if not packing_available(torch.bfloat16):
            return "oneDNN cannot pack bf16 weights here"
        if not fused.usable(torch.empty(0)):
            return "the kernel library did not load"
        return None

    def token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """int64 [N]: each row's argmax over the exact fp32 logits of hidden [N, K] fp32;
        None when some row's screen is inconclusive (the caller computes the logits)."""
        n = hidden.shape[0]
        if hidden.dtype != torch.float32 or n == 0:
            return None
        hidden = hidden.contiguous()
        approx = packed_linear(hidden.to(torch.bfloat16), self.packed, None, self.vocab)
        abs_err = hidden.norm(dim=1).mul_(self._abs_per_norm).add_(1e-30)
        idx, count = fused.screen_rows_bf16(approx, abs_err, OUTPUT_REL, CAP)
        if bool((count < 1).any()):
            return None
        if int(count.max()) == 1:
            return idx[:, 0].clone()
        # Every row's candidates in one flat list (row-major: each row's increasing).
        cand = idx[torch.arange(CAP)[None, :] < count[:, None]]
        row_of = torch.repeat_interleave(torch.arange(n), count)
        exact = (self.weight.index_select(0, cand) * hidden.index_select(0, row_of)).sum(1)
        best = torch.full((n,), float("-inf")).scatter_reduce(0, row_of, exact, "amax")
        at_best = torch.where(exact == best[row_of], cand, self.vocab)
        return torch.full((n,), self.vocab).scatter_reduce(0, row_of, at_best, "amin")


def build_greedy_screen(weight: torch.Tensor) -> GreedyScreen | None:
    """The screen for an fp32 LM head weight on this CPU, or None (logged once either way)."""
    why_not = GreedyScreen.available()
    if why_not is not None:
        logger.info("greedy steps compute the fp32 logits in full: %s", why_not)
        return None
    screen = GreedyScreen(weight)
    logger.info(
        "greedy steps screen the fp32 LM head in bf16 and recheck in fp32 (a bf16 copy of "
        "the head: %.1f MB)",
        screen.extra_bytes / 1e6,
    )
    return screen
