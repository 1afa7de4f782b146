"""`Fp8Rows`: a checkpoint's e4m3 weight with one fp32 scale per output row, as loaded.

A pre-quantized fp8 checkpoint (compressed-tensors `float-quantized`) hands its layers
these rather than float tensors, so that on a GPU with fp8 tensor cores `Fp8Linear`
keeps the checkpoint's own bytes and scales (no second rounding), and everywhere else
`QuantLinear` dequantizes them once at load. A per-tensor scale is expanded to one per
row, which is the same number in every row (exact), and lets fused q/k/v rows with
different tensor scales concatenate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Rows:
    q: torch.Tensor  # float8_e4m3fn [rows, cols]
    scale: torch.Tensor  # float32 [rows]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[rows, cols] q * scale, computed in fp32 (exact up to one fp32 rounding)."""
        return (self.q.float() * self.scale.float()[:, None]).to(dtype)

    def narrow(self, dim: int, start: int, stop: int, length: int) -> Fp8Rows:
        """Rows or columns [start, stop), zero-padded to `length` (tensor parallelism)."""
        stop = min(stop, self.shape[dim])
        start = min(start, stop)
        q = self.q.narrow(dim, start, stop - start)
        scale = self.scale[start:stop] if dim == 0 else self.scale
        if length > stop - start:
            pad = list(q.shape)
            pad[dim] = length - (stop - start)
            q = torch.cat([q, q.new_zeros(pad)], dim)
            if dim == 0:
                scale = torch.cat([scale, scale.new_zeros(pad[0])])
        return Fp8Rows(q.contiguous(), scale.contiguous())

    def to(self, device: torch.device) -> Fp8Rows:
        return Fp8Rows(self.q.to(device), self.scale.to(device))


def concat_fp8_rows(parts: list[Fp8Rows]) -> Fp8Rows:
    return Fp8Rows(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
