"""Greedy tokens of an fp32 model without its fp32 logits: a bf16 screen, then an fp32 recheck.

A greedy step needs each row's argmax, not its logits. At W64's 64 rows the fp32 LM head
(49,152 x 512) took 18 ms of a ~60 ms decode step on an AMX Xeon (2 threads), the same GEMM
in bf16 4.4 ms; at one row 3.3 ms against 1.9 (the bf16 weight is half the bytes). So on a
CPU that computes bf16 natively (`cpu_features.native_bf16`) an fp32 model keeps a bf16 copy
of its LM head (half the fp32 head's bytes more in memory, logged at start) and a greedy step:

1. computes the logits in bf16 (`a_j`, fp32 accumulation, rounded to bf16 on output);
2. bounds each one's error, exactly as the rounding went: x.w_j - x~.w~_j = (x - x~).w_j +
   x~.(w_j - w~_j), so by Cauchy-Schwarz |a_j - z_j| <= ||x - x~|| ||w_j|| + ||x~|| ||w_j -
   w~_j|| (the residual norms measured, per step for the row, once for the head's rows),
   plus gamma_K = K 2^-24 / (1 - K 2^-24) of ||x|| ||w_j|| for each of the two fp32 sums
   (the bf16 GEMM's and the fp32 logits' we compare against) and 2^-8 |a_j| for rounding
   the sums to bf16; all times 1.01 for the roundings of the bound itself;
3. keeps every index whose upper bound reaches the row's largest lower bound
   (`screen_rows_bf16` in csrc/fused_ops.c): the exact maximum is among them;
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

OUTPUT_REL = 2.0**-8  # rounding the fp32 sums to bf16 logits (2^-9, doubled for slack)
SLACK = 1.01
CAP = 128  # candidates per row before the step falls back to the full logits


class GreedyScreen:
    """Argmax rows of hidden @ weight^T for an fp32 weight [V, K], exactly, from a bf16 GEMM.

    `weight` is kept by reference (the model's LM head or tied embedding) for the recheck."""

    def __init__(self, weight: torch.Tensor):
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"the screen takes an fp32 [V, K] weight, not {weight.dtype}")
        self.weight = weight.detach()
        self.vocab, k = self.weight.shape
        rounded = self.weight.to(torch.bfloat16)
        self.packed = pack_weight(rounded, amx=False)  # oneDNN: the bound was measured on it
        w64, r64 = self.weight.double(), rounded.double()
        # Per vocabulary row: a norm bounding both ||w_j|| and ||w~_j||, and ||w_j - w~_j||.
        self.w_norm = (torch.maximum(w64.norm(dim=1), r64.norm(dim=1)) * SLACK).float()
        self.w_resid = ((w64 - r64).norm(dim=1) * SLACK).float()
        self._gamma = k * 2.0**-24 / (1.0 - k * 2.0**-24)
        self.extra_bytes = self.weight.numel() * 2 + 2 * self.vocab * 4

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
        rounded = hidden.to(torch.bfloat16)
        approx = packed_linear(rounded, self.packed, None, self.vocab)
        wide = rounded.float()
        x_norm, r_norm = hidden.norm(dim=1), wide.norm(dim=1)
        alpha = ((hidden - wide).norm(dim=1) + self._gamma * (x_norm + r_norm)) * SLACK
        idx, count = fused.screen_rows_bf16(
            approx, alpha, r_norm * SLACK, self.w_norm, self.w_resid, OUTPUT_REL, CAP
        )
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
