"""`QuantLinear` and `QuantEmbedding`: a layer's weight format is the layer's business.

The model files build plain linears; `engine.worker.quant.install` swaps in these modules
before the weights load, and from then on the model calls them like any linear. Each one
loads its own checkpoint tensors (`load_tensor`: float rows, or GGUF blocks already in
one of the two block formats of `blocks.py`), joins fused projections (q/k/v, gate/up) row
by row, and after the load (`finalize`) holds one of:

    q4 / q8 blocks   the CPU kernels multiply them as they are (no float copy kept); q4
                     blocks are regrouped at load into column groups (blocks.py,
                     `to_column_groups`: the same bytes, 16 output columns side by side),
                     the layout csrc/quant_linear_q4g.c reads at memory speed. Kept in
                     GGUF's layout: with int8 activations (their kernel reads that one),
                     without the kernel library, and for the token embedding (looked up
                     by rows)
    a dense weight   a float tensor the checkpoint carried as float (under `auto`), or any
                     weight on CUDA, where blocks are dequantized once to the model dtype
                     at load (logged): the CUDA kernels for these formats are not built

The kernel choice by row count lives here and only here (`QuantLinear.forward`), on the
CPU with the kernel library loaded:

    rows <  dense_rows   csrc/quant_linear_q4g.c for q4 column groups, csrc/quant_linear.c
                         for q8 (`model.quant_activations` float, the default): fp32 rows
                         times the weights widened in registers, exactly the dequantized
                         weights' products; bf16 rows in and out of one C call (q4 groups:
                         on AMD the bf16 dot product of q with the rows, exact per product;
                         on Intel the rows as exact int16 planes times q by VPDPWSSD; else
                         widened inside); or csrc/quant_linear_i8.c (int8):
                         the rows rounded to int8 per 32 values, then below INT8_DOT_ROWS
                         one byte-wise multiply-add per block, from there the rounded rows
                         through the fp32 kernel. All read each block once per 4 rows.
                         `dense_rows`: 32 with bf16 (or int8) activations, 64 with fp32
                         ones (bench/linear_kernels.py, docs/quantization.md)
    rows >= dense_rows   dequantize into a scratch buffer shared by the model's layers,
                         then the dense GEMM (its cache blocking wins once a weight pass is
                         amortized over many rows; the buffer holds one layer): fp32, or
                         with bf16 activations a bf16 copy and the bf16 GEMM (half the
                         bytes written and read, twice the FLOPs on AVX512-BF16 / AMX)

The same rule on every x86 ISA, with the code the compiler targets: the q4 column-group
kernel has AVX-512 (with AVX512-BF16: the bf16 dot product; with AVX512-VNNI: int16 planes),
AVX2 + FMA + F16C and plain C paths (bf16 rows are widened to fp32 inside the C call where
neither applies);
the q8 and int8 kernels are AVX2 + FMA + F16C code with AVX-512 row paths (the int8 one uses
VNNI's `dpbusd` where the compiler targets AVX512-VNNI or AVX-VNNI, `maddubs` + `madd`
otherwise). With int8 activations the dense path rounds
the rows the same way before its GEMM (`round_activations_int8`), so both sides of the
rule compute the same product and a request's tokens do not depend on its batch.
Without the kernel library (no compiler, `runtime.cpu_kernels: false`) every
call dequantizes and uses F.linear: correct, slow, logged once at load.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.kernels import quant as qkernels
from engine.worker.quant.blocks import (
    BLOCK,
    Q4,
    Q4G,
    Q8,
    BlockTensor,
    concat_rows,
    dequantize,
    from_column_groups,
    quantize_q4,
    quantize_q8,
    round_activations_int8,
    to_column_groups,
)
from engine.worker.quant.fp8_rows import Fp8Rows

logger = logging.getLogger(__name__)

# Rows from which dequantize + dense GEMM beats the block kernels, by activation dtype (see
# the module docstring; bench/linear_kernels.py measures both on the model's shapes): with
# bf16 rows the bf16 GEMM (AVX512-BF16 / AMX) overtakes the kernel at ~24-32 rows; the fp32
# kernel keeps up with the fp32 GEMM to ~64 rows and spares the dequantized copy. Int8
# activations keep 32 (their rounded rows go through the fp32 kernel below it).
DENSE_ROWS = 32
DENSE_ROWS_FP32 = 64


def dense_rows(dtype: torch.dtype, int8_activations: bool = False) -> int:
    """The row count from which a quantized linear takes the dense path (the one rule)."""
    return DENSE_ROWS_FP32 if dtype == torch.float32 and not int8_activations else DENSE_ROWS


# With int8 activations, rows below this take the integer dot products; from here on the
# rounded rows go through the fp32 block kernel (the same product: the per-row scale work
# of the integer path costs more than fp32 FMAs shared by a tile of 4 rows).
INT8_DOT_ROWS = 4


class DenseScratch:
    """The buffers (one per dtype: fp32, and bf16 for bf16 activations) the layers of one
    model dequantize into for large batches (they run one after another, so one layer's
    size is enough)."""

    def __init__(self) -> None:
        self._bufs: dict[torch.dtype, torch.Tensor] = {}

    def take(self, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < rows * cols:
            buf = self._bufs[dtype] = torch.empty(rows * cols, dtype=dtype)
        return buf[: rows * cols].view(rows, cols)


class QuantLinear(nn.Module):
    """A linear layer whose weight may be block-quantized; see the module docstring.

    `shard_sizes` (fused projections) maps each HF shard name to its output rows in
    concatenation order; `target` is the block kind float tensors are quantized to at load
    (None keeps them dense), `group` the int4 group width (a multiple of 32)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        shard_sizes: dict[str, int] | None = None,
        target: int | None,
        group: int = BLOCK,
        scratch: DenseScratch | None = None,
        dtype: torch.dtype = torch.float32,
        column_groups: bool = True,
    ):
        """`column_groups` False keeps q4 blocks in GGUF's layout (a lookup table's rows)."""
        super().__init__()
        self.column_groups = column_groups
        self.in_features, self.out_features = in_features, out_features
        self.target, self.group = target, group
        self.scratch = scratch or DenseScratch()
        self.act_dtype = dtype
        self.shards = shard_sizes or {"": out_features}
        if shard_sizes is not None:  # read by LoRA to place each slice's delta
            self.shard_offsets: dict[str, tuple[int, int]] = {}
            start = 0
            for name, size in shard_sizes.items():
                self.shard_offsets[name] = (start, size)
                start += size
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.register_buffer("qdata", torch.empty(0, dtype=torch.uint8), persistent=False)
        self.register_buffer("dense", torch.empty(0), persistent=False)
        self.kind: int | None = None  # Q4 / Q4G / Q8 once finalized with blocks; None: dense
        self._staged: dict[str, torch.Tensor | BlockTensor] = {}
        self._biases: dict[str, torch.Tensor] = {}
        self.finalized = False
        # The small-rows kernels, bound, by `_small_rows_kernel`'s name.
        self._bound: dict[str | None, qkernels.BoundLinear] = {}
        # Small batches on int8 activations (csrc/quant_linear_i8.c) rather than fp32 ones.
        self.int8_activations = False

    # ---- loading ------------------------------------------------------------------------
    def load_tensor(self, leaf: str, shard: str | None, tensor: torch.Tensor | BlockTensor):
        """One checkpoint tensor: `leaf` "weight" or "bias" of shard `shard` (None: the
        whole layer)."""
        shard = "" if shard is None else shard
        if shard not in self.shards:
            raise ValueError(f"unknown shard {shard!r}")
        rows = self.shards[shard]
        if leaf == "bias":
            if self.bias is None or tuple(tensor.shape) != (rows,):
                raise ValueError(f"bias of shard {shard!r}: unexpected {tuple(tensor.shape)}")
            self._biases[shard] = tensor.float()
            return
        if leaf != "weight" or tuple(tensor.shape) != (rows, self.in_features):
            raise ValueError(
                f"{leaf} of shard {shard!r}: expected {(rows, self.in_features)}, got "
                f"{tuple(tensor.shape)}"
            )
        self._staged[shard] = tensor

    def finalize(self) -> str:
        """Joins the staged shards into the layer's weight; returns its format's name."""
        # A pre-quantized fp8 checkpoint's rows, where no Fp8Linear keeps them: float.
        parts = [p.dequantize() if isinstance(p, Fp8Rows) else p for p in self._take_parts()]
        device = self._device()
        blocks = _as_blocks(parts, self.target, self.group)
        if blocks is None:  # every part float and nothing to quantize to
            self.dense = torch.cat([p.to(self.act_dtype) for p in parts]).to(device)
            return f"dense {str(self.act_dtype).removeprefix('torch.')}"
        if device.type != "cpu":  # no CUDA block kernels: dequantized once, to the run dtype
            self.dense = dequantize(blocks, self.act_dtype).to(device)
            return f"{_NAMES[blocks.kind]} dequantized to {self.act_dtype} on {device.type}"
        self.kind, self.qdata = blocks.kind, blocks.data.contiguous()
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().float().contiguous(), requires_grad=False)
        if qkernels.available():
            if self.kind == Q4 and self.column_groups and not self.int8_activations:
                self.kind, self.qdata = Q4G, to_column_groups(blocks)
            names = ("dot", "rounded") if self.int8_activations else (None,)
            self._bound = {
                n: qkernels.BoundLinear(
                    self.qdata, self.kind, self.in_features, self.bias, n, rows=self.out_features
                )
                for n in names
            }
        return _NAMES[blocks.kind]

    def _take_parts(self) -> list:
        """The staged shards in order, checked complete; the biases copied into `bias`."""
        self.finalized = True
        missing = [s or "weight" for s in self.shards if s not in self._staged]
        if missing:
            raise ValueError(f"checkpoint is missing {', '.join(missing)}")
        parts = [self._staged[s] for s in self.shards]
        if self.bias is not None:
            with torch.no_grad():
                self.bias.copy_(torch.cat([self._biases.get(s, torch.zeros(n))
                                           for s, n in self.shards.items()]))  # fmt: skip
        self._staged, self._biases = {}, {}
        return parts

    def _device(self) -> torch.device:
        return self.bias.device if self.bias is not None else self.qdata.device

    def blocks(self) -> BlockTensor:
        """The weight as q4 / q8 blocks in GGUF's layout (whatever layout is kept)."""
        if self.kind == Q4G:
            return from_column_groups(self.qdata, self.out_features, self.in_features)
        if self.kind is None:
            raise ValueError("a dense layer has no blocks")
        return BlockTensor(self.kind, self.qdata, self.in_features)

    def weight_bytes(self) -> int:
        return self.qdata.numel() + self.dense.numel() * self.dense.element_size()

    # ---- forward ------------------------------------------------------------------------
    def _small_rows_kernel(self, rows: int) -> str | None:
        """Below `dense_rows`: None (fp32 products), or with int8 activations "dot" (integer
        dot products) / "rounded" (the rounded rows, fp32 products)."""
        if not self.int8_activations:
            return None
        return "dot" if rows < INT8_DOT_ROWS else "rounded"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        dense_from = dense_rows(x.dtype, self.int8_activations)
        if self._bound and x.dim() == 2 and 0 < x.shape[0] < dense_from:
            fast = self._bound[self._small_rows_kernel(x.shape[0])]
            # The decode step: no reshape; bf16 rows in and out of one C call.
            if x.dtype == torch.float32 and x.stride(-1) == 1:
                return fast(x)
            if x.dtype == torch.bfloat16:
                if self.int8_activations:
                    return fast(x.float()).to(torch.bfloat16)
                return fast.bf16(x if x.stride(-1) == 1 else x.contiguous())
        if self.kind is None:
            return F.linear(x, self.dense, None if self.bias is None else self.bias.to(x.dtype))
        lead = x.shape[:-1]
        rows = x.numel() // self.in_features
        if x.dtype == torch.bfloat16 and rows >= dense_from and not self.int8_activations:
            # bf16 activations, many rows: the bf16 GEMM on a bf16 dequantized copy.
            bias = None if self.bias is None else self.bias.to(torch.bfloat16)
            w = self._dense_weight(torch.bfloat16)
            y = F.linear(x.reshape(rows, self.in_features), w, bias)
            return y.view(*lead, self.out_features)
        x2 = x.reshape(-1, self.in_features).float()
        if rows == 0:
            y = x2.new_empty(0, self.out_features)
        elif rows < dense_from and qkernels.available():
            kernel = self._small_rows_kernel(rows)
            y = qkernels.linear(
                x2, self.qdata, self.kind, self.in_features, self.bias, kernel, self.out_features
            )
        else:
            if self.int8_activations:  # the same activations the int8 kernel multiplies
                x2 = round_activations_int8(x2)
            y = F.linear(x2, self._dense_weight(), self.bias)
        return y.to(x.dtype).view(*lead, self.out_features)

    def _dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not qkernels.available():
            return dequantize(self.blocks(), dtype)
        if self.kind == Q4G:  # written transposed (16 columns at a time); a [N, K] view
            out_t = self.scratch.take(self.in_features, self.out_features, dtype)
            return qkernels.dequantize_t_into(self.qdata, self.in_features, out_t).t()
        out = self.scratch.take(self.out_features, self.in_features, dtype)
        return qkernels.dequantize_into(self.qdata, self.kind, self.in_features, out)

    def extra_repr(self) -> str:
        fmt = _NAMES.get(self.kind, "dense")
        return f"in={self.in_features}, out={self.out_features}, format={fmt}"


class QuantEmbedding(nn.Module):
    """The token embedding kept in q8 blocks (GGUF's Q8_0 `token_embd`, or quantized at load
    because the LM head is tied to it). A lookup dequantizes only the ids' rows; `head`
    (set by `install.finalize_model`) is the tied LM head reading the same bytes.

    Under tensor parallelism it holds this rank's vocabulary rows, like
    `VocabParallelEmbedding`: ids outside them give zeros, then one all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp, vocab_start: int, dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp, self.vocab_start, self.act_dtype = tp, vocab_start, dtype
        self.linear = QuantLinear(
            embedding_dim, num_embeddings, False, target=None, dtype=dtype, column_groups=False
        )

    def load_tensor(self, leaf: str, shard: str | None, tensor):
        self.linear.load_tensor(leaf, shard, tensor)

    def finalize(self) -> str:
        return self.linear.finalize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden], a new tensor
        lin = self.linear
        local = ids - self.vocab_start if self.tp.size > 1 else ids
        outside = (local < 0) | (local >= self.num_embeddings)
        safe = local.masked_fill(outside, 0) if self.tp.size > 1 else local
        if lin.kind is None:
            x = F.embedding(safe, lin.dense)
        else:
            rows = BlockTensor(lin.kind, lin.qdata.index_select(0, safe), self.embedding_dim)
            x = dequantize(rows, self.act_dtype)
        if self.tp.size == 1:
            return x
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


_NAMES = {Q4: "q4 blocks", Q8: "q8 blocks"}


def _as_blocks(parts: list, target: int | None, group: int) -> BlockTensor | None:
    """The parts (float tensors or BlockTensors) as one BlockTensor, or None when all are
    float and `target` is None. Parts in different block kinds (a GGUF that stores v_proj
    in Q6_K beside q/k in Q4_K) all go to q8."""
    if all(not isinstance(p, BlockTensor) for p in parts) and target is None:
        return None
    quantized = []
    for p in parts:
        if isinstance(p, BlockTensor):
            quantized.append(p)
        elif target == Q4:
            quantized.append(quantize_q4(p, group))
        else:
            quantized.append(quantize_q8(p))
    if len({p.kind for p in quantized}) > 1:
        quantized = [p if p.kind == Q8 else quantize_q8(dequantize(p)) for p in quantized]
    return concat_rows(quantized)
