"""A minimal stand-in for the runner: drive a model step by step over a paged KV cache.

Tests use it to feed prompts in chunks and batches exactly as the engine would (flattened
tokens, block tables, slot mapping), without the scheduler or the real runner.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.worker.attention.base import AttentionBackend, AttentionMetadata, ForwardContext
from engine.worker.attention.kv_dtype import new_kv_cache


def build_metadata(
    q_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    slot_overrides: dict[int, int] | None = None,
) -> AttentionMetadata:
    """Metadata for requests whose last `q_lens[i]` of `seq_lens[i]` tokens are new this step.

    Slots come from each request's block table; `slot_overrides` (token index -> slot) lets a
    test set some to -1.
    """
    num_reqs = len(q_lens)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    positions, slots = [], []
    for n, s, table in zip(q_lens, seq_lens, block_tables, strict=True):
        for p in range(s - n, s):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    for t, slot in (slot_overrides or {}).items():
        slots[t] = slot
    max_blocks = max(len(t) for t in block_tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
    )


class PagedRun:
    """Owns a KV cache and per-request block tables; `step` runs one batched forward.

    Blocks are handed out in a shuffled order so block tables are not contiguous.
    """

    def __init__(
        self,
        model: Any,
        backend: AttentionBackend,
        num_blocks: int = 128,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ):
        self.model, self.backend, self.block_size = model, backend, block_size
        self.device = torch.device(device)
        shape = (num_blocks, 2, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [  # `dtype` fp8: e4m3 pages (a backend that reads them: FlashInfer)
            new_kv_cache(shape, dtype, self.device) for _ in range(model.num_layers)
        ]
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[Any, list[int]] = {}
        self.lens: dict[Any, int] = {}

    @torch.no_grad()
    def step(self, chunks: dict[Any, list[int]]) -> dict[Any, torch.Tensor]:
        """Feed `chunks[req]` (new token ids) for each request; returns logits [n, vocab] each."""
        reqs = list(chunks)
        q_lens, seq_lens, tables, ids = [], [], [], []
        for r in reqs:
            table = self.tables.setdefault(r, [])
            new_len = self.lens.get(r, 0) + len(chunks[r])
            while len(table) * self.block_size < new_len:
                table.append(self.free.pop())
            self.lens[r] = new_len
            q_lens.append(len(chunks[r]))
            seq_lens.append(new_len)
            tables.append(table)
            ids += chunks[r]
        md = build_metadata(q_lens, seq_lens, tables, self.block_size, self.device)
        self.backend.begin_step(md)
        ctx = ForwardContext(attn_metadata=md, kv_caches=self.kv_caches, backend=self.backend)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, md.positions, ctx)
        logits = self.model.compute_logits(hidden)
        return dict(zip(reqs, logits.split(q_lens), strict=True))
