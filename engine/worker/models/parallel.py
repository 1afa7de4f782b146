"""What one tensor-parallel rank holds of a model, and the collectives its forward needs.

Megatron-style sharding over `size` ranks (rank 0 is the engine's own process):

    qkv_proj, gate_up_proj   column-parallel: each rank computes its heads / its slice of
                             the intermediate features; no communication
    o_proj, down_proj        row-parallel: each rank multiplies its input slice, then one
                             all-reduce (sum) gives every rank the full output
    embed_tokens             vocab-parallel: a rank looks up the ids in its vocabulary rows,
                             zeros elsewhere, then one all-reduce
    lm_head                  vocab-parallel: each rank computes its vocabulary columns of the
                             logits; they are gathered on rank 0, which samples

KV heads are split like the query heads while there are at least as many KV heads as
ranks; with more ranks than KV heads each KV head is replicated on `size / num_kv_heads`
ranks (the ranks whose query heads read it). `TensorParallel()` (size 1) is the single-device
model: every collective is the identity, so the TP=1 path computes exactly what it did
before sharding existed.

The collectives use torch.distributed's default process group, set up by
`engine.worker.distributed.group` (gloo on the CPU, NCCL on CUDA); this module does not
care which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among `size` tensor-parallel ranks; `device` holds its tensors
    (NCCL reduces CUDA tensors only, so small control tensors are made there)."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks in place and returns it (the identity at size 1)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """[N, C] on every rank -> [N, size * C] (rank order) on rank 0, None on the others;
        `x` itself at size 1."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=1) if parts is not None else None

    def min_int(self, n: int) -> int:
        """The smallest `n` over the ranks (every rank gets it)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def even_split(total: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal share of `total`; ValueError naming `what` when
    `size` does not divide it."""
    if total % tp.size:
        raise ValueError(f"{what} ({total}) is not divisible by {tp.size} ranks")
    n = total // tp.size
    return tp.rank * n, n


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes: query heads [q_start, q_start + num_heads) and
    KV heads [kv_start, kv_start + num_kv_heads) of the full model."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def head_shard(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
    """Query heads split evenly; KV heads split evenly when there are at least as many as
    ranks, else replicated: rank r reads KV head r // (size / num_kv_heads), the one its
    query heads are grouped with. Raises ValueError when neither divides the other."""
    q_start, heads = even_split(num_heads, tp, "num_attention_heads")
    if num_kv_heads >= tp.size:
        kv_start, kv_heads = even_split(num_kv_heads, tp, "num_key_value_heads")
        return HeadShard(heads, kv_heads, q_start, kv_start)
    if tp.size % num_kv_heads:
        raise ValueError(
            f"{tp.size} ranks cannot share {num_kv_heads} KV heads (neither divides the other)"
        )
    return HeadShard(heads, 1, q_start, tp.rank // (tp.size // num_kv_heads))


def vocab_rows(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows per rank) of the vocabulary-parallel embedding and LM head. The
    vocabulary is padded up to a multiple of `size`; the padding rows are zero and their
    logits are dropped on rank 0."""
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this rank's vocabulary rows; ids outside them contribute zeros and
    one all-reduce sums the ranks' lookups. At size 1 it is plain nn.Embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        self.vocab_start, rows = vocab_rows(vocab_size, tp)
        super().__init__(rows, hidden_size)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden], a new tensor
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)
