"""The attention backend interface and the per-step context the model receives.

Every backend reads and writes the same paged KV layout, one tensor per layer:

    kv_cache[layer]: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)

which is FlashInfer's NHD paged layout, so a cache is backend-agnostic. Token t of a step is
written to slot `slot_mapping[t]` = block_id * block_size + offset (or nowhere when -1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Static shape and options of one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # tokens a query may look back, itself included
    logits_soft_cap: float | None = None


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the flattened batch and in the paged cache.

    Requests are laid out back to back: request i owns tokens
    query_start_loc[i] : query_start_loc[i+1] of the step, which are its positions
    seq_lens[i] - query_len_i ... seq_lens[i] - 1.
    """

    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 writes nowhere
    positions: torch.Tensor  # [num_tokens] int64
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that plan on the CPU without a device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache, then attends over each request's blocks."""

    name: str = "abstract"

    def begin_step(self, metadata: AttentionMetadata) -> None:  # noqa: B027
        """Called once per step before the forward; backends plan here, shared by all layers."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        layer: AttentionLayerSpec,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


@dataclass
class ForwardContext:
    """Everything a model forward needs besides token ids and positions; passed explicitly."""

    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per layer
    backend: AttentionBackend
