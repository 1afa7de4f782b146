"""Pure-torch paged attention: the exact reference and the CPU path.

Per layer it (1) scatters the step's new K/V into the cache at `slot_mapping` (skipping -1)
and (2) attends, for all requests at once, over each request's blocks:

    keys      [R, L, Hkv, D]       gathered via block_tables, L = blocks_needed * block_size
    queries   [R, Q, H, D]         the step's tokens padded per request, Q = max_query_len
    scores    [R, Hkv, G*Q, L]     G = H // Hkv query heads share one kv head (GQA)

Request r's query i sits at position p = seq_len_r - query_len_r + i and sees key j when

    j <= p  and  (no window or p - window < j)

so earlier chunks in the cache are visible and the chunk itself is causal. Softmax runs in
float32 (then back to the value dtype) to match transformers' eager attention. Index plans
that depend only on the metadata are built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.worker.attention.base import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from engine.worker.kernels import attention as native


@dataclass
class _StepPlan:
    """Index tensors for one step, identical for every layer; built from host lists only."""

    key: tuple  # (query_start_loc, seq_lens, num_tokens, block_size) it was built from
    num_reqs: int
    max_q: int
    num_blocks: int  # block-table columns any request needs
    token_req: torch.Tensor | None  # [T] request of each token (None: 1 token/request)
    token_idx: torch.Tensor | None  # [T] index of the token within its request's chunk
    q_pos: torch.Tensor  # [R, Q] position of each (padded) query; pads get position 0
    k_pos: torch.Tensor  # [L] key positions 0..L-1
    blocked: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> mask
    split: _Split | None = None  # mixed steps: decode/prefill partition, built on demand
    # The native kernel's partition: short chunks (speculative verify steps) go row by row.
    native_split: _Split | None = None
    items: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # native kernel
    # (dtype, window) -> (chunks for the prefill kernel, the other prefill chunks)
    prefill_kernel: dict[tuple, tuple[list, list]] = field(default_factory=dict)

    def blocked_mask(self, window: int | None) -> torch.Tensor:
        """Boolean [R, 1, 1, Q, L], True where a query may NOT see a key (None = no window)."""
        if window not in self.blocked:
            q = self.q_pos[:, None, None, :, None]  # [R, 1, 1, Q, 1]
            k = self.k_pos[None, None, None, None, :]  # [1, 1, 1, 1, L]
            blocked = k > q
            if window is not None:
                blocked |= k <= q - window
            self.blocked[window] = blocked
        return self.blocked[window]


def _plan_key(md: AttentionMetadata) -> tuple:
    return (
        tuple(md.query_start_loc_cpu[: md.num_reqs + 1]),
        tuple(md.seq_lens_cpu[: md.num_reqs]),
        md.num_tokens,
        md.block_size,
    )


class TorchPagedBackend(AttentionBackend):
    """Exact paged attention on the CPU (and the reference elsewhere).

    Decode rows are batched: on the CPU with fp32 queries through the C kernel in
    `engine/worker/kernels/attention.py`, which reads K/V in place from the blocks; otherwise (no
    compiler, other devices or dtypes, `native=False`) through SDPA over an index_select
    gather of their blocks. Each prefill chunk gets one SDPA call over its gathered blocks.
    """

    name = "torch"

    def __init__(self, native: bool = True) -> None:
        self._plan: _StepPlan | None = None
        self.native = native

    def begin_step(self, metadata: AttentionMetadata) -> None:
        self._plan = self._build_plan(metadata, _plan_key(metadata))

    def _get_plan(self, metadata: AttentionMetadata) -> _StepPlan:
        # Keyed on the host lists rather than object identity, so a runner that reuses (and
        # mutates) one metadata object, or skips begin_step, never gets a stale plan.
        key = _plan_key(metadata)
        if self._plan is None or self._plan.key != key:
            self._plan = self._build_plan(metadata, key)
        return self._plan

    @staticmethod
    def _build_plan(md: AttentionMetadata, key: tuple) -> _StepPlan:
        device = md.block_tables.device
        starts, seq_lens, num_tokens, block_size = key
        num_reqs = len(seq_lens)
        q_lens = [starts[i + 1] - starts[i] for i in range(num_reqs)]
        max_q = max(q_lens, default=1)
        num_blocks = -(-max(seq_lens, default=1) // block_size)
        q_pos = [
            [s - n + i if i < n else 0 for i in range(max_q)]
            for s, n in zip(seq_lens, q_lens, strict=True)
        ]
        if max_q == 1 and num_tokens == num_reqs:
            token_req = token_idx = None
        else:
            req = [r for r, n in enumerate(q_lens) for _ in range(n)]
            idx = [i for n in q_lens for i in range(n)]
            token_req = torch.tensor(req, dtype=torch.long).to(device, non_blocking=True)
            token_idx = torch.tensor(idx, dtype=torch.long).to(device, non_blocking=True)
        return _StepPlan(
            key=key,
            num_reqs=num_reqs,
            max_q=max_q,
            num_blocks=num_blocks,
            token_req=token_req,
            token_idx=token_idx,
            q_pos=torch.tensor(q_pos, dtype=torch.long).view(num_reqs, max_q).to(device),
            k_pos=torch.arange(num_blocks * block_size, device=device),
        )

    @staticmethod
    def write_kv(
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [>= T] int64, -1 = skip
    ) -> None:
        """Scatter new K/V into their cache slots; tokens with slot -1 are not stored."""
        num_tokens = k.shape[0]
        slots = slot_mapping[:num_tokens]
        if num_tokens and int(slots.min()) < 0:  # padding tokens: keep only real slots
            keep = (slots >= 0).nonzero().squeeze(1)
            slots, k, v = slots[keep], k[keep], v[keep]
        block_size = kv_cache.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[blocks, 0, offsets] = k.to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = v.to(kv_cache.dtype)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        metadata: AttentionMetadata,
        layer: AttentionLayerSpec,
    ) -> torch.Tensor:  # [T, H, D]
        if self.native and native.can_write_kv(k, v, kv_cache):
            native.write_kv(k, v, kv_cache, metadata.slot_mapping)
        else:
            self.write_kv(k, v, kv_cache, metadata.slot_mapping)
        if layer.logits_soft_cap is not None:
            return self._forward_padded(q, kv_cache, metadata, layer)
        plan = self._get_plan(metadata)
        num_tokens, H, D = metadata.num_tokens, layer.num_heads, layer.head_dim
        if self.native and native.supports(q, kv_cache, H, layer.num_kv_heads):
            return self._attend_native(q, k, v, kv_cache, metadata, layer, plan)
        if plan.token_req is None:  # decode only
            result = self._attend_decode(q[:num_tokens], kv_cache, metadata, layer, None)
        else:
            result = q.new_empty(num_tokens, H, D)
            split = _split_plan(plan, metadata)
            if split.decode_reqs.numel():
                result[split.decode_tokens] = self._attend_decode(
                    q[split.decode_tokens], kv_cache, metadata, layer, split.decode_reqs
                )
            for r, start, end in split.prefills:
                result[start:end] = self._attend_chunk(q[start:end], kv_cache, metadata, layer, r)
        if q.shape[0] != num_tokens:  # padded batch (e.g. graph buckets): zero the pad rows
            result = torch.cat([result, result.new_zeros(q.shape[0] - num_tokens, H, D)])
        return result

    def native_items(self, md: AttentionMetadata):
        """(rows, reqs, pos) for the native kernel when it attends every token of this step
        (decode rows and chunks of at most ROW_CHUNK_MAX tokens, no padding), else None: what
        a caller that runs the kernel itself (models/cpu_stack.py) may hand it."""
        if not self.native:
            return None
        plan = self._get_plan(md)
        if plan.token_req is not None and _split_plan(plan, md, ROW_CHUNK_MAX).prefills:
            return None
        return self._items(plan, md)

    @staticmethod
    def _items(plan: _StepPlan, md: AttentionMetadata):
        if plan.items is None:
            if plan.token_req is None:
                rows = torch.arange(md.num_tokens, dtype=torch.long)
                plan.items = (rows, rows, md.positions[: md.num_tokens].long().contiguous())
            else:
                split = _split_plan(plan, md, ROW_CHUNK_MAX)
                rows = split.decode_tokens
                plan.items = (rows, split.decode_reqs, md.positions[rows].long().contiguous())
        return plan.items

    def _attend_native(self, q, k, v, kv_cache, md: AttentionMetadata, layer, plan: _StepPlan):
        """Decode rows in one kernel call reading the cache in place; prefill chunks that are
        their request's whole context in one call of the prefill kernel (`_kernel_chunks`),
        the others (a cached prefix, a window, long bf16 chunks) by SDPA each.

        The row kernel handles one query row at a time, which is right for decode (memory-
        bound) but wastes blocked matmuls on a chunk of many queries (compute-bound). A
        chunk of at most `ROW_CHUNK_MAX` tokens (a request verifying speculative proposals)
        is memory-bound too: its rows join the decode rows, each seeing keys up to its own
        position, so a verify step of many requests is one kernel call, not one SDPA each."""
        rows, reqs, pos = self._items(plan, md)
        out = q.new_empty(q.shape[0], layer.num_heads, layer.head_dim)
        if q.shape[0] != md.num_tokens:  # padded batch: pad rows stay zero
            out[md.num_tokens :] = 0
        if rows.numel():
            native.paged_attention(
                q, kv_cache, md.block_tables, rows, reqs, pos, out, layer.scale,
                layer.sliding_window,
            )  # fmt: skip
        if plan.token_req is not None:
            whole, prefills = _kernel_chunks(plan, md, layer, q.dtype)
            if not (whole and native.prefill_attention(q, k, v, out, whole, layer.scale)):
                prefills = _split_plan(plan, md, ROW_CHUNK_MAX).prefills
            for r, start, end in prefills:
                kv = (k[start:end], v[start:end])
                out[start:end] = self._attend_chunk(q[start:end], kv_cache, md, layer, r, kv)
        return out

    @staticmethod
    def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, rows: int, L: int):
        """K and V of the listed blocks as [rows, Hkv, L, D] views over one copy each."""
        Hkv, D = kv_cache.shape[3], kv_cache.shape[4]
        flat = block_ids.reshape(-1)
        keys = kv_cache[:, 0].index_select(0, flat).view(rows, L, Hkv, D).transpose(1, 2)
        values = kv_cache[:, 1].index_select(0, flat).view(rows, L, Hkv, D).transpose(1, 2)
        return keys, values

    def _attend_decode(self, q, kv_cache, md: AttentionMetadata, layer, reqs):
        """One query per request: SDPA over each request's gathered blocks, length-masked."""
        plan = self._get_plan(md)
        block_size = kv_cache.shape[2]
        tables = md.block_tables[: plan.num_reqs] if reqs is None else md.block_tables[reqs]
        seq_lens = md.seq_lens[: plan.num_reqs] if reqs is None else md.seq_lens[reqs]
        R = tables.shape[0]
        nb = -(-int(max(md.seq_lens_cpu[: plan.num_reqs])) // block_size)
        L = nb * block_size
        keys, values = self._gather(kv_cache, tables[:, :nb].long(), R, L)
        k_pos = plan.k_pos[:L]
        last = seq_lens.long()[:, None] - 1  # [R, 1] position of the query
        visible = k_pos[None, :] <= last
        if layer.sliding_window is not None:
            visible &= k_pos[None, :] > last - layer.sliding_window
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(keys.dtype),  # [R, H, 1, D]
            keys,
            values,
            attn_mask=visible[:, None, None, :],
            scale=layer.scale,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        return out.squeeze(2).to(q.dtype)  # [R, H, D]

    def _attend_chunk(self, q, kv_cache, md: AttentionMetadata, layer, r: int, chunk_kv=None):
        """A prefill chunk of one request: causal within the chunk, earlier context visible.

        `chunk_kv` is the chunk's own (k, v) [n, Hkv, D]: when the chunk is the request's
        whole context (a prompt's first chunk, no cached prefix) they are exactly what the
        cache now holds for it, so they are used as they are instead of gathered back."""
        block_size = kv_cache.shape[2]
        seq_len = md.seq_lens_cpu[r]
        n = q.shape[0]
        if chunk_kv is not None and seq_len == n:
            keys, values = (t.to(kv_cache.dtype).transpose(0, 1).unsqueeze(0) for t in chunk_kv)
        else:
            nb = -(-seq_len // block_size)
            tables = md.block_tables[r, :nb].long()
            keys, values = self._gather(kv_cache, tables, 1, nb * block_size)
            keys, values = keys[:, :, :seq_len], values[:, :, :seq_len]
        qh = q.transpose(0, 1).unsqueeze(0).to(keys.dtype)  # [1, H, n, D]
        gqa = layer.num_heads != layer.num_kv_heads
        if seq_len == n and layer.sliding_window is None:
            out = F.scaled_dot_product_attention(
                qh, keys, values, is_causal=True, scale=layer.scale, enable_gqa=gqa
            )
        else:
            q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            visible = k_pos <= q_pos
            if layer.sliding_window is not None:
                visible &= k_pos > q_pos - layer.sliding_window
            out = F.scaled_dot_product_attention(
                qh, keys, values, attn_mask=visible, scale=layer.scale, enable_gqa=gqa
            )
        return out[0].transpose(0, 1).to(q.dtype)  # [n, H, D]

    def _forward_padded(self, q, kv_cache, metadata: AttentionMetadata, layer):
        """Exact masked-matmul path over padded queries (used for logits soft-capping)."""
        plan = self._get_plan(metadata)
        R, Q = plan.num_reqs, plan.max_q
        num_tokens, H, D = metadata.num_tokens, layer.num_heads, layer.head_dim
        Hkv = layer.num_kv_heads
        G = H // Hkv

        # Queries, padded per request: [R, Q, H, D]
        if plan.token_req is None:
            q_pad = q[:num_tokens].unsqueeze(1)  # decode-only: one query per request
        elif R == 1:
            q_pad = q[:num_tokens].unsqueeze(0)  # one request: nothing to pad
        else:
            q_pad = q.new_zeros(R, Q, H, D)
            q_pad[plan.token_req, plan.token_idx] = q[:num_tokens]
        # [R, Q, Hkv, G, D] -> [R, Hkv, G*Q, D]
        q_pad = q_pad.view(R, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(R, Hkv, G * Q, D)

        block_size = kv_cache.shape[2]
        L = plan.num_blocks * block_size
        tables = metadata.block_tables[:R, : plan.num_blocks].long()
        keys, values = self._gather(kv_cache, tables, R, L)
        keys, values = keys.to(q.dtype), values.to(q.dtype)

        scores = torch.matmul(q_pad, keys.transpose(-1, -2)) * layer.scale  # [R, Hkv, G*Q, L]
        if layer.logits_soft_cap is not None:
            cap = layer.logits_soft_cap
            scores = torch.tanh(scores / cap) * cap
        scores = scores.view(R, Hkv, G, Q, L)
        scores = scores.masked_fill(plan.blocked_mask(layer.sliding_window), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        out = torch.matmul(probs.view(R, Hkv, G * Q, L), values)  # [R, Hkv, G*Q, D]
        out = out.view(R, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(R, Q, H, D)

        if plan.token_req is None:
            result = out.squeeze(1)  # decode-only: [R, H, D]
        elif R == 1:
            result = out[0]
        else:
            result = out[plan.token_req, plan.token_idx]  # [T, H, D]
        if q.shape[0] != num_tokens:
            result = torch.cat([result, result.new_zeros(q.shape[0] - num_tokens, H, D)])
        return result


@dataclass
class _Split:
    """A mixed step split into its decode rows (batched) and prefill chunks (one each)."""

    decode_reqs: torch.Tensor  # [Rd] each decode row's request
    decode_tokens: torch.Tensor  # [Rd] the decode rows (token rows of the step)
    prefills: list[tuple[int, int, int]]  # (request, first token row, end row)


# Chunks of at most this many tokens run row by row in the native kernel (see _attend_native).
ROW_CHUNK_MAX = 17
# Longer bf16 chunks go to SDPA, whose AMX/bf16 GEMMs beat the prefill kernel's fp32 FMAs
# alone (n=256: 0.41 against 0.64-0.72 ms; Xeon with AMX, 2 threads). Up to it the kernel
# wins in place: W64's 14 chunks of 32-256 tokens a step took 2.9 ms in one call against
# 6.0-7.3 ms for one SDPA call each (SDPA alone 0.25 ms for 150 tokens, in a loop over
# different chunks ~2.5x that). fp32 chunks of any length take the kernel (n=150: 0.24 against
# 0.44-0.54 ms; n=1024: 6.8 against 9.2-9.5 ms).
BF16_KERNEL_CHUNK_MAX = 256


def _kernel_chunks(
    plan: _StepPlan, md: AttentionMetadata, layer: AttentionLayerSpec, dtype: torch.dtype
) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """The step's prefill chunks split for the prefill kernel (csrc/prefill_attention.c):
    its (start, end) rows, and the (request, start, end) chunks left to SDPA. A chunk goes to
    the kernel when it is its request's whole context (no cached prefix, no earlier chunk),
    the layer has no sliding window, and in bf16 it has at most BF16_KERNEL_CHUNK_MAX tokens.
    Built once per step for each (dtype, window), shared by the layers."""
    key = (dtype, layer.sliding_window)
    if key not in plan.prefill_kernel:
        kernel, rest = [], []
        for r, start, end in _split_plan(plan, md, ROW_CHUNK_MAX).prefills:
            n = end - start
            whole = md.seq_lens_cpu[r] == n and layer.sliding_window is None
            if whole and (dtype == torch.float32 or n <= BF16_KERNEL_CHUNK_MAX):
                kernel.append((start, end))
            else:
                rest.append((r, start, end))
        plan.prefill_kernel[key] = (kernel, rest)
    return plan.prefill_kernel[key]


def _split_plan(plan: _StepPlan, md: AttentionMetadata, row_chunk_max: int = 1) -> _Split:
    """Requests with at most `row_chunk_max` query tokens as rows (each token one row with
    its request), the others as prefill chunks; built once per step and partition."""
    cached = plan.split if row_chunk_max == 1 else plan.native_split
    if cached is not None:
        return cached
    starts = md.query_start_loc_cpu
    dec_reqs, dec_rows, pre = [], [], []
    for r in range(plan.num_reqs):
        if starts[r + 1] - starts[r] <= row_chunk_max:
            dec_reqs.extend([r] * (starts[r + 1] - starts[r]))
            dec_rows.extend(range(starts[r], starts[r + 1]))
        else:
            pre.append((r, starts[r], starts[r + 1]))
    device = md.block_tables.device
    dec_t = torch.tensor(dec_reqs, dtype=torch.long, device=device)
    rows = torch.tensor(dec_rows, dtype=torch.long, device=device)
    split = _Split(dec_t, rows, pre)
    if row_chunk_max == 1:
        plan.split = split
    else:
        plan.native_split = split
    return split
