"""The two block formats our quantized linears keep, in torch: build, slice, dequantize.

Both are GGUF's own byte layouts, so a GGUF Q4_1 or Q8_0 tensor loads by copying bytes:

    q4  20 bytes per 32 weights: fp16 d, fp16 m, 16 bytes of nibbles (byte j: weight j in
        the low nibble, weight j + 16 in the high one); w = d * q + m, q in 0..15
    q8  34 bytes per 32 weights: fp16 d, 32 int8; w = d * q

A weight [N, K] is a uint8 tensor [N, (K / 32) * bytes], row after row, so rows (output
features: fused q/k/v, tensor-parallel row shards) concatenate and slice as plain rows,
and columns slice at block boundaries. `dequantize` is the torch reference of what the C
kernels (engine/worker/kernels/csrc/quant_linear.c) compute; `quantize_q4` / `quantize_q8`
quantize float weights at load (`model.quantization: int4 | int8`).

A layer's q4 blocks are regrouped once loaded (`to_column_groups`, kind `Q4G`): the same d,
m and q bytes with 16 output columns side by side, the layout the small-batch kernels
read fastest (csrc/quant_linear_q4g.c); `from_column_groups` gives the blocks back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
Q4 = 4
Q8 = 8
BLOCK_BYTES = {Q4: 20, Q8: 34}
# q4 in column groups (csrc/quant_q4g.h; kernels/quant.py: Q4G_KIND): 16 columns x one
# block = 320 bytes
Q4G = 16
GROUP_COLS = 16
GROUP_BLOCK_BYTES = GROUP_COLS * BLOCK_BYTES[Q4]


@dataclass(frozen=True)
class BlockTensor:
    """A quantized [rows, cols] weight in one of the two block formats."""

    kind: int  # Q4 or Q8
    data: torch.Tensor  # uint8 [rows, cols / 32 * BLOCK_BYTES[kind]]
    cols: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def narrow(self, dim: int, start: int, stop: int, length: int) -> BlockTensor:
        """Rows or (block-aligned) columns [start, stop), zero-padded to `length` along dim
        (vocabulary padding under tensor parallelism)."""
        stop = min(stop, self.shape[dim])
        start = min(start, stop)
        if dim == 0:
            data = self.data[start:stop]
            if length > data.shape[0]:
                pad = data.new_zeros(length - data.shape[0], data.shape[1])
                data = torch.cat([data, pad])
            return BlockTensor(self.kind, data.contiguous(), self.cols)
        if start % BLOCK or (stop % BLOCK and stop != self.cols) or length != stop - start:
            raise ValueError(
                f"columns {start}:{stop} of a quantized weight do not fall on its "
                f"{BLOCK}-column blocks"
            )
        nbytes = BLOCK_BYTES[self.kind]
        data = self.data[:, start // BLOCK * nbytes : stop // BLOCK * nbytes]
        return BlockTensor(self.kind, data.contiguous(), stop - start)

    def nbytes(self) -> int:
        return self.data.numel()


def _blocks(data: torch.Tensor, kind: int) -> torch.Tensor:
    return data.view(data.shape[0], -1, BLOCK_BYTES[kind])  # [N, nb, bytes]


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 (little-endian fp16)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def dequantize(t: BlockTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows, cols] in `dtype`: what the kernels multiply by (the reference for tests)."""
    b = _blocks(t.data, t.kind)
    d = _half(b[..., 0:2])
    if t.kind == Q4:
        qs = b[..., 4:20]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # weights 0..15, then 16..31
        w = q * d[..., None] + _half(b[..., 2:4])[..., None]
    else:
        q = b[..., 2:34].contiguous().view(torch.int8).float()
        w = q * d[..., None]
    return w.reshape(t.rows, t.cols).to(dtype)


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> BlockTensor:
    """q uint8 [N, K] in 0..15, d and m [N, K / 32] -> q4 blocks (d, m rounded to fp16)."""
    n, k = q.shape
    qb = q.to(torch.uint8).view(n, k // BLOCK, BLOCK)
    nibbles = qb[..., :16] | (qb[..., 16:] << 4)
    head = torch.stack([d, m], dim=-1).to(torch.float16).view(torch.uint8)  # [N, nb, 4]
    data = torch.cat([head.view(n, k // BLOCK, 4), nibbles], dim=-1)
    return BlockTensor(Q4, data.reshape(n, -1).contiguous(), k)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> BlockTensor:
    """q int8 [N, K], d [N, K / 32] -> q8 blocks (d rounded to fp16)."""
    n, k = q.shape
    head = d.to(torch.float16).contiguous().view(torch.uint8).view(n, k // BLOCK, 2)
    body = q.to(torch.int8).contiguous().view(torch.uint8).view(n, k // BLOCK, BLOCK)
    return BlockTensor(Q8, torch.cat([head, body], dim=-1).reshape(n, -1).contiguous(), k)


def quantize_q4(w: torch.Tensor, group: int = BLOCK) -> BlockTensor:
    """Asymmetric 4-bit per group of `group` columns (a multiple of 32): d = (max - min) / 15,
    m = min, q = round((w - m) / d). Groups wider than a block repeat their d and m."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    # Rounded to fp16 first so q is computed against the scale the kernel will use.
    d = ((hi - lo) / 15).to(torch.float16).float()
    m = lo.to(torch.float16).float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = ((g - m[..., None]) / safe[..., None]).round().clamp(0, 15).reshape(n, k)
    per_block = group // BLOCK
    return pack_q4(q, d.repeat_interleave(per_block, 1), m.repeat_interleave(per_block, 1))


def quantize_q8(w: torch.Tensor) -> BlockTensor:
    """Symmetric 8-bit per block of 32 columns: d = max|w| / 127, q = round(w / d)."""
    n, k = w.shape
    g = w.float().reshape(n, k // BLOCK, BLOCK)
    d = (g.abs().amax(-1) / 127).to(torch.float16).float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = (g / safe[..., None]).round().clamp(-127, 127).reshape(n, k)
    return pack_q8(q, d)


def to_column_groups(t: BlockTensor) -> torch.Tensor:
    """q4 blocks [N, K] -> uint8 [ceil(N / 16), K / 32 * 320] in the column-group layout of
    csrc/quant_linear_q4g.c: per group of 16 columns (the last zero-padded), per block, the
    16 fp16 d, the 16 fp16 m, then 8 chunks of 4 features where column i's two bytes are
    q[k] | q[k+2] << 4 and q[k+1] | q[k+3] << 4."""
    if t.kind != Q4:
        raise ValueError("only q4 blocks regroup")
    n, nb = t.rows, t.cols // BLOCK
    groups = -(-n // GROUP_COLS)
    b = t.data.view(n, nb, BLOCK_BYTES[Q4])
    if groups * GROUP_COLS != n:
        b = torch.cat([b, b.new_zeros(groups * GROUP_COLS - n, nb, BLOCK_BYTES[Q4])])
    nib = b[..., 4:20]
    q = torch.cat([nib & 0x0F, nib >> 4], dim=-1)  # [N', nb, 32]: weights 0..31 of a block

    def per_group(x: torch.Tensor) -> torch.Tensor:  # [N', nb, ...] -> [G, nb, 16, ...]
        return x.reshape(groups, GROUP_COLS, nb, *x.shape[2:]).transpose(1, 2)

    d, m = per_group(b[..., 0:2]), per_group(b[..., 2:4])  # [G, nb, 16, 2]
    qg = per_group(q.reshape(-1, nb, 8, 4)).transpose(2, 3)  # [G, nb, 8 chunks, 16, 4]
    chunk = torch.stack([qg[..., 0] | (qg[..., 2] << 4), qg[..., 1] | (qg[..., 3] << 4)], -1)
    parts = [d.reshape(groups, nb, 32), m.reshape(groups, nb, 32), chunk.reshape(groups, nb, 256)]
    return torch.cat(parts, dim=-1).reshape(groups, nb * GROUP_BLOCK_BYTES).contiguous()


def from_column_groups(data: torch.Tensor, rows: int, cols: int) -> BlockTensor:
    """The inverse of `to_column_groups`: q4 blocks [rows, cols]."""
    nb = cols // BLOCK
    g = data.view(-1, nb, GROUP_BLOCK_BYTES)
    groups = g.shape[0]

    def per_column(x: torch.Tensor) -> torch.Tensor:  # [G, nb, 16, ...] -> [N', nb, ...]
        return x.transpose(1, 2).reshape(groups * GROUP_COLS, nb, *x.shape[3:])

    d = per_column(g[..., 0:32].reshape(groups, nb, GROUP_COLS, 2))
    m = per_column(g[..., 32:64].reshape(groups, nb, GROUP_COLS, 2))
    chunk = g[..., 64:].reshape(groups, nb, 8, GROUP_COLS, 2)
    q4 = torch.stack(
        [chunk[..., 0] & 0x0F, chunk[..., 1] & 0x0F, chunk[..., 0] >> 4, chunk[..., 1] >> 4], -1
    )  # [G, nb, 8, 16, 4]: q[k .. k+3]
    q = per_column(q4.transpose(2, 3)).reshape(-1, nb, BLOCK)  # [N', nb, 32]
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    blocks = torch.cat([d, m, nibbles], dim=-1)[:rows]
    return BlockTensor(Q4, blocks.reshape(rows, -1).contiguous(), cols)


def concat_rows(parts: list[BlockTensor]) -> BlockTensor:
    kinds = {p.kind for p in parts}
    cols = {p.cols for p in parts}
    if len(kinds) != 1 or len(cols) != 1:
        raise ValueError("fused projections must share one block format and width")
    return BlockTensor(parts[0].kind, torch.cat([p.data for p in parts]), parts[0].cols)


def round_activations_int8(x: torch.Tensor) -> torch.Tensor:
    """fp32 rows [M, K] rounded to 8 bits per 32 values exactly as csrc/quant_linear_i8.c
    rounds them (in fp32: d = max|x| / 127, q = round-half-even(x * (1 / d)), x~ = q d), so
    the dense large-batch path multiplies the same activations as the int8 kernel."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).view(x.shape)
