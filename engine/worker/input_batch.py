"""Per-request state the runner keeps between steps, and the flattening of one step into tensors.

The scheduler sends full data for a request once (`NewRequestData`) and diffs afterwards, so
the runner keeps each request's token ids and block table here. `build_step_inputs` turns
one `SchedulerOutput` into flat token ids, positions and slot mapping plus the attention
metadata, with NumPy doing the per-token work so the cost per request stays a few µs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.core.step_io import SchedulerOutput, TokenLogprobs
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.worker.attention.base import AttentionMetadata
from engine.worker.structured.matcher import GrammarState

if TYPE_CHECKING:
    from engine.worker.lora.peft_adapter import LoRAWeights


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]  # prompt + output, including the last sampled token
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Structured outputs: the request's matcher, advanced by each sampled token.
    grammar: GrammarState | None = None
    # The request's LoRA adapter (None: the base model).
    lora: LoRAWeights | None = None
    # A prefill-only (embedding) request's params, and its pooling result so far across
    # prefill chunks (engine/worker/pooling/pooler.py).
    pooling: PoolingParams | None = None
    pooled_partial: torch.Tensor | None = None


@dataclass
class StepInputs:
    """One step, flattened: request i owns tokens query_start_loc[i]:query_start_loc[i+1]."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    # Rows of the flattened batch whose hidden state predicts the next token, and their
    # request (once per row: a request verifying k proposals has 1 + k consecutive rows).
    sample_rows: list[int]
    sample_req_ids: list[str]
    # (request id, first row, first position, count) of prompt positions needing logprobs.
    prompt_logprob_spans: list[tuple[str, int, int, int]]
    # Speculative decoding: request id -> its first row in `sample_rows` and the proposals
    # its 1 + len(proposals) rows verify; only requests with proposals.
    spec_rows: dict[str, tuple[int, list[int]]] = field(default_factory=dict)


def build_step_inputs(
    so: SchedulerOutput,
    states: dict[str, CachedRequestState],
    block_size: int,
    device: torch.device,
    req_ids: list[str] | None = None,
) -> StepInputs:
    """`req_ids`: the order of the step's requests in the flat batch (default: the
    scheduler's). A request with proposals (`so.spec_token_ids`) runs its last known token
    and the proposals, and samples after each of them."""
    req_ids = list(so.num_scheduled_tokens) if req_ids is None else req_ids
    num_reqs = len(req_ids)
    query_lens = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), np.int64, num_reqs)
    computed = np.fromiter((states[r].num_computed_tokens for r in req_ids), np.int64, num_reqs)
    step_states = [states[r] for r in req_ids]
    meta = build_attention_metadata(
        query_lens, computed, [st.block_ids for st in step_states], block_size, device
    )

    # The per-request loop reads Python ints (NumPy scalars cost ~100 ns per access) and
    # gathers token ids into a flat list, converted to an array once.
    spec = so.spec_token_ids
    flat_tokens: list[int] = []
    sample_rows: list[int] = []
    sample_req_ids: list[str] = []
    prompt_spans: list[tuple[str, int, int, int]] = []
    spec_rows: dict[str, tuple[int, list[int]]] = {}
    starts, ends, row0s = computed.tolist(), meta.seq_lens_cpu, meta.query_start_loc_cpu
    for i, (rid, st) in enumerate(zip(req_ids, step_states, strict=True)):
        start, end = starts[i], ends[i]
        tokens = st.token_ids
        draft = spec.get(rid) if spec else None
        if draft:
            end -= len(draft)  # the proposals follow the known tokens
        if end - start == 1:
            flat_tokens.append(tokens[start])
        else:
            flat_tokens += tokens[start:end]
        if draft:
            flat_tokens += draft
            spec_rows[rid] = (len(sample_rows), draft)
            last = row0s[i + 1]
            sample_rows.extend(range(last - 1 - len(draft), last))
            sample_req_ids.extend([rid] * (1 + len(draft)))
        elif end == len(tokens):
            sample_rows.append(row0s[i + 1] - 1)
            sample_req_ids.append(rid)
        if st.params.prompt_logprobs is not None and start < st.num_prompt_tokens - 1:
            # Position p predicts prompt token p + 1; the last prompt position is a sample row.
            count = min(end, st.num_prompt_tokens - 1) - start
            prompt_spans.append((rid, row0s[i], start, count))
    token_ids = np.array(flat_tokens, np.int64)
    return StepInputs(
        req_ids=req_ids,
        input_ids=torch.from_numpy(token_ids).to(device),
        positions=meta.positions,
        attn_metadata=meta,
        sample_rows=sample_rows,
        sample_req_ids=sample_req_ids,
        prompt_logprob_spans=prompt_spans,
        spec_rows=spec_rows,
    )


def build_attention_metadata(
    query_lens: np.ndarray,
    computed: np.ndarray,
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Positions, slot mapping and block tables of requests running `query_lens[i]` tokens
    from position `computed[i]` with tables `block_ids[i]`."""
    num_reqs = len(query_lens)
    seq_lens = computed + query_lens
    qsl = np.zeros(num_reqs + 1, np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    total = int(qsl[-1])

    # positions[t] = computed[i] + (t - qsl[i]) for t in request i's range.
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)
    positions = np.arange(total, dtype=np.int64) - qsl[:-1][req_of_token] + computed[req_of_token]

    max_blocks = max((len(b) for b in block_ids), default=1)
    block_tables = np.zeros((num_reqs, max(max_blocks, 1)), np.int32)
    for i, blocks in enumerate(block_ids):
        block_tables[i, : len(blocks)] = blocks
    slot_mapping = (
        block_tables[req_of_token, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    meta = AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=total,
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(block_tables).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        positions=torch.from_numpy(positions).to(device),
        max_query_len=int(query_lens.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        block_size=block_size,
    )
    return meta
