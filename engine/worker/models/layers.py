"""Small building blocks shared by the model files.

RMSNorm follows transformers' arithmetic (fp32 statistics, weight applied in the input dtype)
so fp32 results match the reference; fused projections are plain `nn.Linear`s whose output
rows are the concatenation of the HF projections, filled shard by shard by `load_shard`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] (gate rows then up rows) -> silu(gate) * up, [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class FusedLinear(nn.Linear):
    """A linear layer whose output rows are several HF projections stacked in order.

    `shard_sizes` maps each HF shard name (e.g. "q", "k", "v") to its number of output rows,
    in concatenation order.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def load_shard(self, param: torch.Tensor, shard: str, loaded: torch.Tensor) -> None:
        """Copy one HF projection's weight or bias into its rows of `param` (weight or bias)."""
        start, size = self.shard_offsets[shard]
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shard {shard!r}: expected {(size, *param.shape[1:])}, got {tuple(loaded.shape)}"
            )
        with torch.no_grad():
            param[start : start + size].copy_(loaded)
