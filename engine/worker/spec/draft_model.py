"""A draft model: a smaller model with the target's tokenizer proposes the next tokens.

Its paged KV lives in the target's block ids (one cache tensor per draft layer, indexed by
the same block table), so its blocks are allocated, copied on write and freed with the
target's, through the one KV-fit rule; KV sizing counts both per block. The scheduler
allocates, past the target's slots of a step, the slots of the tokens the draft will feed
after it (`SchedulerOutput.num_lookahead_tokens`), and gives them back after verification.

After each target step:

1. one forward over what the target's step made final: for every request in the step, its
   scheduled positions whose K/V stand (a prefill chunk; a decode's last token and the
   accepted proposals), plus, for a request that proposes, the token just sampled. This
   keeps the draft's KV equal to the target's prefix, prefix-cache hits, preemption and
   rejected positions included (a rejected position is rewritten before it is read);
2. for the requests that propose k tokens: the first proposal from that forward's last
   row, then k - 1 one-token steps, each feeding the previous proposal.

A greedy request's proposals are the draft's argmax. A sampled request's are drawn from
the draft's distribution at its temperature, q, kept for the rejection rule.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.config import RuntimeConfig
from engine.worker.attention.base import ForwardContext
from engine.worker.attention.selection import select_attention_backend
from engine.worker.input_batch import build_attention_metadata
from engine.worker.sampler import position_seed, row_argmax
from engine.worker.spec.proposer import ProposeContext, WorkerProposer


class DraftModelProposer(WorkerProposer):
    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        runtime: RuntimeConfig,
    ):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        cpu_kernels = runtime.cpu_kernels and not runtime.compile
        if cpu_kernels and device.type == "cpu" and hasattr(model, "enable_cpu_kernels"):
            model.enable_cpu_kernels()
        self.backend = select_attention_backend(
            device, dtype, cpu_kernels, setting=runtime.attention_backend,
            specs=model.attention_specs, block_size=block_size,
        ).backend  # fmt: skip
        elem = torch.empty((), dtype=dtype).element_size()
        self.kv_bytes_per_block = (
            model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * elem
        )
        self.kv_caches: list[torch.Tensor] = []
        # Request -> (its last proposals, q of each when sampled: [k, V]).
        self._q: dict[str, tuple[list[int], torch.Tensor]] = {}

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = (num_blocks, 2, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(m.num_layers)
        ]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for cache in self.kv_caches:
            cache[dst] = cache[src]

    def draft_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None:
        kept = self._q.get(request_id)
        if kept is None or kept[0][: len(drafts)] != drafts:
            return None
        return kept[1][: len(drafts)]

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self._q.pop(rid, None)

    # ---- proposing ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        feed_ids, feed_tokens, feed_starts, proposing = [], [], [], []
        for rid in ctx.inputs.req_ids:
            self._q.pop(rid, None)
            st = ctx.states.get(rid)
            valid = ctx.num_valid.get(rid, 0)
            if st is None or not valid:
                continue
            start = ctx.starts[rid]
            k = ctx.lookahead.get(rid, 0)
            sampled_here = len(st.token_ids) == start + valid + 1
            k = min(k, self._room(st, len(st.token_ids))) if sampled_here else 0
            tokens = st.token_ids[start : start + valid + (1 if k else 0)]
            feed_ids.append(rid)
            feed_tokens.append(tokens)
            feed_starts.append(start)
            if k:
                proposing.append((len(feed_ids) - 1, rid, k))
        if not feed_ids:
            return {}
        last_hidden = self._forward(feed_tokens, feed_starts, [ctx.states[r] for r in feed_ids])
        if not proposing:
            return {}
        rows = torch.tensor([i for i, _, _ in proposing], device=self.device)
        logits = self.model.compute_logits(last_hidden.index_select(0, rows))
        reqs = [(rid, k, ctx.states[rid]) for _, rid, k in proposing]
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid, _, _ in reqs}
        live = reqs
        for j in range(max(k for _, k, _ in reqs)):
            if j:
                tokens = [[drafts[rid][-1]] for rid, _, _ in live]
                starts = [len(st.token_ids) - 1 + j for _, _, st in live]
                logits = self.model.compute_logits(
                    self._forward(tokens, starts, [st for _, _, st in live])
                )
            picked = self._pick(logits, live, j)
            for (rid, _, _), (tok, q) in zip(live, picked, strict=True):
                drafts[rid].append(tok)
                if q is not None:
                    probs[rid].append(q)
            live = [r for r in live if len(drafts[r[0]]) < r[1]]
            if not live:
                break
        for rid, _, _ in reqs:
            if probs[rid]:
                self._q[rid] = (drafts[rid], torch.stack(probs[rid]))
        return drafts

    def _room(self, st, num_tokens: int) -> int:
        """Proposals whose KV slots (positions num_tokens - 1 ..) the table holds."""
        return len(st.block_ids) * self.block_size - num_tokens + 1

    def _forward(self, tokens: list[list[int]], starts: list[int], states) -> torch.Tensor:
        """The draft's last hidden state of each request's fed tokens, [R, H]."""
        query_lens = np.fromiter((len(t) for t in tokens), np.int64, len(tokens))
        computed = np.asarray(starts, np.int64)
        meta = build_attention_metadata(
            query_lens, computed, [st.block_ids for st in states], self.block_size, self.device
        )
        flat = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long)
        self.backend.begin_step(meta)
        fwd = ForwardContext(meta, self.kv_caches, self.backend)
        hidden = self.model(flat.to(self.device), meta.positions, fwd)
        last = torch.tensor(meta.query_start_loc_cpu[1:], device=self.device) - 1
        return hidden.index_select(0, last)

    def _pick(self, logits: torch.Tensor, live, j: int) -> list[tuple[int, torch.Tensor | None]]:
        """Each live request's next proposal: the argmax (greedy) or a draw from q."""
        logits = logits.float()
        greedy_ids = row_argmax(logits).tolist()
        out: list[tuple[int, torch.Tensor | None]] = []
        for i, (_, _, st) in enumerate(live):
            params = st.params
            if params.greedy:
                out.append((greedy_ids[i], None))
                continue
            q = torch.softmax(logits[i] / params.temperature, dim=-1)
            u = torch.empty_like(q)
            if params.seed is not None:
                gen = torch.Generator(device=q.device)
                pos = len(st.token_ids) - st.num_prompt_tokens + j
                gen.manual_seed(position_seed(params.seed, pos, stream=1))
                u.uniform_(generator=gen)
            else:
                u.uniform_()
            e = u.log_().neg_().clamp_(min=torch.finfo(u.dtype).tiny)
            out.append((int((q / e).argmax()), q))
        return out
