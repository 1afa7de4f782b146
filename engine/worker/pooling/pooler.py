"""Pooling a step's hidden states into one vector per finished prompt.

A prompt may arrive in several prefill chunks (chunked prefill under the step's token
budget), so pooling keeps a partial result per request between steps, in the request's
runner state (dropped with it when the request finishes, is aborted or preempted; a
resumed request recomputes its prompt from token 0):

    last   the hidden state of the prompt's last token (in its last chunk)
    cls    the hidden state of its first token (in its first chunk), kept until the last
    mean   a running float32 sum over every chunk's rows, divided by the prompt length

One step's rows for request i are `query_start_loc[i]:query_start_loc[i+1]`, positions
`seq_len - query_len .. seq_len - 1`; the prompt is done when `seq_len` reaches it. Then
the vector is cut to the request's `dimensions` and L2-normalized when asked (in that
order, as vLLM does, so a shortened vector is unit length too), in float32, and returned
as plain floats.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.pooling_params import PoolingParams
from engine.worker.pooling.spec import PoolingSpec


class PoolingState(Protocol):
    """What the pooler reads and keeps in a request's runner state."""

    num_prompt_tokens: int
    pooling: PoolingParams | None
    pooled_partial: torch.Tensor | None


class Pooler:
    """The model's pooling (from its `PoolingSpec`) applied to each step's hidden states."""

    def __init__(self, spec: PoolingSpec):
        self.spec = spec

    def pool(
        self,
        hidden: torch.Tensor,  # [T, H] the step's final hidden states
        req_ids: list[str],
        query_start_loc: list[int],  # [R + 1] each request's first row
        seq_lens: list[int],  # [R] each request's tokens computed after this step
        states: Mapping[str, PoolingState],
    ) -> dict[str, list[float]]:
        """request id -> its embedding, for every request whose prompt is done this step."""
        method = self.spec.method
        if method == "mean":
            self._accumulate_sums(hidden, req_ids, query_start_loc, seq_lens, states)
        done_ids: list[str] = []
        done_rows: list[int] = []  # last: the row to take; cls/mean: -1 (kept partial)
        first_rows: list[tuple[str, int]] = []  # cls: a prompt's first row, this step
        for i, rid in enumerate(req_ids):
            st = states[rid]
            row0, row1, end = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
            start = end - (row1 - row0)
            if method == "cls" and start == 0:
                first_rows.append((rid, row0))
            if end >= st.num_prompt_tokens:
                done_ids.append(rid)
                done_rows.append(row1 - 1)
        if first_rows:
            rows = torch.tensor([r for _, r in first_rows], device=hidden.device)
            firsts = hidden.index_select(0, rows).float()
            for j, (rid, _) in enumerate(first_rows):
                states[rid].pooled_partial = firsts[j]
        if not done_ids:
            return {}
        if method == "last":
            rows = torch.tensor(done_rows, device=hidden.device)
            vecs = hidden.index_select(0, rows).float()  # [N, H]
        else:
            vecs = torch.stack([self._take_partial(states[rid]) for rid in done_ids])
        return self._finish(vecs, [states[rid].pooling for rid in done_ids], done_ids)

    def _accumulate_sums(self, hidden, req_ids, query_start_loc, seq_lens, states) -> None:
        """Adds each request's rows of this step to its running float32 sum (one
        index_add over the whole step, then one add per request)."""
        lens = torch.tensor(
            [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(req_ids))],
            device=hidden.device,
        )
        segment = torch.repeat_interleave(torch.arange(len(req_ids), device=hidden.device), lens)
        sums = torch.zeros(len(req_ids), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, segment, hidden[: query_start_loc[-1]].float())
        for i, rid in enumerate(req_ids):
            st = states[rid]
            start = seq_lens[i] - (query_start_loc[i + 1] - query_start_loc[i])
            if start == 0 or st.pooled_partial is None:
                st.pooled_partial = sums[i]
            else:
                st.pooled_partial = st.pooled_partial + sums[i]

    def _take_partial(self, st: PoolingState) -> torch.Tensor:
        partial, st.pooled_partial = st.pooled_partial, None
        if partial is None:  # cannot happen: the first chunk always sets it
            raise RuntimeError("pooling: a prompt finished without its first chunk's rows")
        if self.spec.method == "mean":
            return partial / st.num_prompt_tokens
        return partial

    def _finish(
        self, vecs: torch.Tensor, params: list[PoolingParams | None], req_ids: list[str]
    ) -> dict[str, list[float]]:
        """Cuts each vector to its request's dimensions and normalizes it if asked; one
        batched normalize and one tolist when every request wants the same (the usual case)."""
        spec = self.spec
        wants = [p or PoolingParams() for p in params]
        norms = [spec.normalizes(p) for p in wants]
        if all(p.dimensions is None for p in wants) and len(set(norms)) == 1:
            out = F.normalize(vecs, p=2.0, dim=1) if norms[0] else vecs
            return dict(zip(req_ids, out.tolist(), strict=True))
        result = {}
        for j, (rid, p) in enumerate(zip(req_ids, wants, strict=True)):
            v = vecs[j] if p.dimensions is None else vecs[j, : p.dimensions]
            if norms[j]:
                v = F.normalize(v, p=2.0, dim=0)
            result[rid] = v.tolist()
        return result
