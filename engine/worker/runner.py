"""ModelRunner: executes one `SchedulerOutput` on the model and answers with a `RunnerOutput`.

The runner owns the model, the paged KV cache tensors and the per-request state it needs to
build inputs (token ids, block tables). It never imports the scheduler: all it knows of a
step arrives in the `SchedulerOutput`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from engine.config import ConfigError, LoRAConfig, RuntimeConfig, SpeculativeConfig
from engine.core.step_io import PromptLogprobsChunk, RunnerOutput, SchedulerOutput, TokenLogprobs
from engine.worker.attention.base import AttentionBackend, ForwardContext
from engine.worker.attention.kv_dtype import is_fp8, new_kv_cache, page_bytes
from engine.worker.attention.selection import (
    FP8_PAGES,
    AttentionChoice,
    select_attention_backend,
)
from engine.worker.decode_graphs import GraphRunner, build_graph_runner
from engine.worker.input_batch import CachedRequestState, StepInputs, build_step_inputs
from engine.worker.lora.model_lora import ModelLoRA
from engine.worker.pooling.pooler import Pooler
from engine.worker.pooling.spec import PoolingSpec
from engine.worker.sampler import (
    PROMPT_LOGPROBS_CHUNK,
    Sampler,
    SamplerOutput,
    SamplingRow,
    compute_prompt_logprobs,
    is_plain_greedy,
    make_generator,
    position_seed,
)
from engine.worker.spec.grammar import forced_tokens, verify_bitmask
from engine.worker.spec.proposer import WorkerProposer, propose_after_step
from engine.worker.spec.verify import RowGroup, accept_chain, draft_rejection, row_groups
from engine.worker.status import AcceleratorStatus, describe_error
from engine.worker.structured.bitmask import fill_bitmask
from engine.worker.structured.compiler import CompiledGrammar
from engine.worker.structured.matcher import GrammarState
from graphs.cuda_graphs import GraphFactory

logger = logging.getLogger(__name__)


class ModelRunner:
    """Builds itself from the loaded model and the runtime options; the engine only calls it.

    Construction applies what changes the model: the CPU kernels (when `runtime.cpu_kernels`
    and not compiling: inductor compiles the plain ops instead) and torch.compile (a
    `CompiledModel` when `runtime.compile`). Decode graphs come later, from `capture_graphs`,
    once the final KV cache is allocated.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        runtime: RuntimeConfig,
        *,
        eos_token_ids: Iterable[int] = (),
        backend: AttentionBackend | None = None,
        flashinfer_module: Any = None,
        lora: LoRAConfig | None = None,
        speculative: SpeculativeConfig | None = None,
        pooling: PoolingSpec | None = None,
        kv_dtype: torch.dtype | None = None,
    ):
        """`pooling`: an embedding model (no LM head): every request is prefill-only, and
        the step answers with pooled vectors instead of samples (no decode graphs then).
        `eos_token_ids`: the model's EOS ids, masked until a request reaches min_tokens.
        `backend`: the attention backend (default: `select_attention_backend` for
        runtime.attention_backend, probed with the model's layers). `flashinfer_module`: a
        stand-in for the flashinfer module (tests). `lora`: with `enabled`, the model's
        linears run LoRA adapters (`engine.worker.lora`; no decode graphs then).
        `speculative`: speculative decoding is on (verification of the step's proposals
        runs either way; this enables the grammar's forced-token proposals). `kv_dtype`: the
        KV pages' element type (`attention.kv_dtype.kv_cache_dtype`; default `dtype`); fp8
        pages need FlashInfer (`select_attention_backend`)."""
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.block_size = block_size
        self.runtime = runtime
        cpu_kernels = runtime.cpu_kernels and not runtime.compile
        if backend is None:
            choice = select_attention_backend(
                device, dtype, cpu_kernels, setting=runtime.attention_backend,
                specs=model.attention_specs, block_size=block_size,
                flashinfer_module=flashinfer_module, kv_dtype=self.kv_dtype,
            )  # fmt: skip
        else:
            choice = AttentionChoice(backend)
            if is_fp8(self.kv_dtype) and backend.name != "flashinfer":
                raise ConfigError("cache.kv_dtype", f"{FP8_PAGES}; given the {backend.name} one")
        self.backend = choice.backend
        # What runs attention and decode, and why not the fast path; final after capture.
        self.status = AcceleratorStatus(choice.backend.name, choice.fallback_reason)
        if cpu_kernels and device.type == "cpu" and hasattr(model, "enable_cpu_kernels"):
            logger.info("CPU kernels: %s", model.enable_cpu_kernels())
        # Wrapped after packing: the LoRA delta is added to the packed base product.
        self.lora = ModelLoRA(model, lora) if lora is not None and lora.enabled else None
        if runtime.compile:  # imported here: torch._dynamo alone takes a second to import
            from engine.worker.compiled_model import CompiledModel

            model = CompiledModel(model, cache_dir=runtime.compile_cache_dir)
        self.model = model
        # Set by `capture_graphs` on CUDA: replays decode-only steps from captured graphs.
        self.graph_runner: GraphRunner | None = None
        self.pooler = Pooler(pooling) if pooling is not None else None
        self.sampler = Sampler()
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos_token_ids))
        self.kv_caches: list[torch.Tensor] = []
        self.states: dict[str, CachedRequestState] = {}
        # llguidance's thread pool for the batch bitmask, made at the first constrained step.
        self._grammar_executor: Any = None
        self.speculative = speculative if speculative is not None and speculative.enabled else None
        # A worker-side proposer (a draft model), set by the engine on the rank that samples.
        self.proposer: WorkerProposer | None = None

    # ---- KV cache -------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = (num_blocks, 2, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [
            new_kv_cache(shape, self.kv_dtype, self.device) for _ in range(m.num_layers)
        ]
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            pages = page_bytes(cache)  # fp8 pages are copied as bytes
            pages[dst] = pages[src]
        if self.proposer is not None:
            self.proposer.copy_blocks(src, dst)

    def capture_graphs(
        self, max_num_seqs: int, max_model_len: int, graph_factory: GraphFactory | None = None
    ) -> None:
        """Captures decode graphs per batch bucket (CUDA only; a no-op that logs why else).

        A capture that fails leaves decode eager, with the reason logged and in `status`.
        Must run after the final KV allocation and before any request holds blocks: the
        all-padding capture batch writes into block 0. `graph_factory`: a stand-in recorder
        (tests; it also lets the capture path run off CUDA)."""
        try:
            self.graph_runner = build_graph_runner(
                self.model, self.backend, self.kv_caches, self.device,
                enabled=self.runtime.cuda_graphs and self.lora is None and self.pooler is None,
                sizes=self.runtime.capture_sizes,
                block_size=self.block_size, max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, graph_factory=graph_factory, dtype=self.dtype,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - any capture failure: decode stays eager
            reason = describe_error(e)
            logger.warning("decode graph capture failed, decode runs eagerly: %s", reason)
            self.graph_runner = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the partial graphs' pool
            self.status = dataclasses.replace(self.status, graphs_fallback_reason=reason)
            return
        self.status = dataclasses.replace(self.status, decode_graphs=self.graph_runner is not None)

    # ---- state updates --------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        # Seeded draws are keyed by output position (`position_seed`), so a request resumed
        # after preemption gets a fresh generator and still draws what it would have.
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        if self.proposer is not None and so.finished_req_ids:
            self.proposer.drop(so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            rid = new.request_id
            gen = make_generator(new.sampling_params.seed, self.device)
            self.states[rid] = CachedRequestState(
                request_id=rid,
                token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                params=new.sampling_params,
                generator=gen,
                grammar=_grammar_state(new.grammar, new.sampling_params, new.output_token_ids),
                lora=new.lora,
                pooling=new.pooling_params,
            )
        for cached in so.scheduled_cached_reqs:
            st = self.states[cached.request_id]
            if cached.num_blocks_kept is not None:
                del st.block_ids[cached.num_blocks_kept :]
            for index, block_id in cached.replaced_block_ids:
                st.block_ids[index] = block_id
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens

    def append_sampled(self, req_ids: list[str], token_ids: list[list[int]]) -> None:
        """A tensor-parallel worker's copy of what rank 0 sampled in the previous step
        (workers do not sample; their next inputs need the tokens)."""
        for rid, toks in zip(req_ids, token_ids, strict=True):
            st = self.states.get(rid)
            if st is not None:
                st.token_ids.extend(toks)

    # ---- execution ------------------------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """The step's flat inputs. With LoRA the requests are ordered by adapter slot (each
        adapter's rows one range) and the step's `LoRABatch` is set (`ModelLoRA`)."""
        if self.lora is None:
            return build_step_inputs(so, self.states, self.block_size, self.device)
        req_ids = list(so.num_scheduled_tokens)
        req_ids, slots = self.lora.order_step(req_ids, [self.states[r].lora for r in req_ids])
        inputs = build_step_inputs(so, self.states, self.block_size, self.device, req_ids)
        self.lora.begin_step(slots, np.diff(inputs.attn_metadata.query_start_loc_cpu))
        return inputs

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self._update_states(so)
        if so.is_empty:
            return RunnerOutput()
        self._copy_blocks(so.block_copies)
        inputs = self.prepare_inputs(so)
        try:
            hidden = self._forward(inputs)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        out = RunnerOutput()
        if self.pooler is not None:  # an embedding model: nothing samples
            meta = inputs.attn_metadata
            out.pooled = self.pooler.pool(
                hidden, inputs.req_ids, meta.query_start_loc_cpu, meta.seq_lens_cpu, self.states
            )
            return out
        self._prompt_logprobs(inputs, hidden, out)
        if inputs.sample_rows:
            rows_hidden = _sample_hidden(hidden, inputs)
            screened = self._screened_greedy(inputs, rows_hidden)
            logits = None
            if screened is None or screened[1] is None:
                # Kept in the model's dtype: the sampler widens them when it needs more than
                # a greedy argmax (a draft model's rejection test reads them in fp32).
                logits = self.model.compute_logits(rows_hidden, keep_dtype=self.proposer is None)
                if logits is None:  # a tensor-parallel worker: rank 0 got them and samples
                    return out
            self._sample(inputs, logits, out, screened)
        if self.proposer is not None:
            propose_after_step(self.proposer, so, inputs, hidden, self.states, out)
        return out

    def _screened_greedy(
        self, inputs: StepInputs, rows_hidden: torch.Tensor
    ) -> tuple[list[SamplingRow], torch.Tensor | None] | None:
        """On a model with a greedy screen (models/greedy_screen.py), a step without
        speculation: its sampling rows and, when every row is plain greedy without logprobs
        and the screen decided, their tokens (the fp32 logits never computed; else None,
        the rows kept for the sampler). None without a screen or with speculation."""
        screen = getattr(self.model, "greedy_screen", None)
        if screen is None or inputs.spec_rows or self.proposer is not None:
            return None
        rows = [self._sampling_row(self.states[rid]) for rid in inputs.sample_req_ids]
        if not is_plain_greedy(rows) or any(r.params.logprobs is not None for r in rows):
            return rows, None
        return rows, screen.token_ids(rows_hidden)

    def _sample(
        self,
        inputs: StepInputs,
        logits: torch.Tensor | None,
        out: RunnerOutput,
        screened: tuple[list[SamplingRow], torch.Tensor | None] | None = None,
    ) -> None:
        """Samples (and verifies the proposals of) every request with sample rows; appends
        the tokens to its state and fills `out`. See `engine.worker.spec.verify`. `screened`:
        what `_screened_greedy` built, the step's rows and, for a screened greedy step, its
        tokens (`logits` is then None)."""
        groups = row_groups(inputs.sample_req_ids, inputs.spec_rows)
        states = [self.states[g.req_id] for g in groups]
        if screened is not None and screened[1] is not None:
            rows, bitmask = screened[0], None
            sampled = SamplerOutput(screened[1].tolist(), [None] * len(rows))
        elif inputs.spec_rows:
            bitmask, constrained = self._verify_bitmask(groups, states, logits.shape)
            rows = [
                self._sampling_row(st, g.drafts[:j], constrained[g.first + j])
                for g, st in zip(groups, states, strict=True)
                for j in range(g.num_rows)
            ]
        else:
            bitmask = self._grammar_bitmask(states, logits.shape[1])
            rows = screened[0] if screened else [self._sampling_row(st) for st in states]
        if screened is None or screened[1] is None:
            sampled = self.sampler(logits, rows, bitmask)
        # Grammars in their error state end their request here, not sampled: their mask
        # allows EOS alone, a "stop" that would break the grammar.
        errors = {
            g.req_id: why
            for g, st in zip(groups, states, strict=True)
            if (why := _grammar_error(st)) is not None
        }
        results = (
            draft_rejection(self.proposer, groups, states, logits, rows, bitmask)
            if self.proposer is not None
            else {}
        )
        all_lps: list[list[TokenLogprobs] | None] = []
        for g, st in zip(groups, states, strict=True):
            if g.req_id in results:
                tokens, fail, lps = results[g.req_id]
            else:
                tokens, fail = accept_chain(sampled.token_ids, g, sampled.failed)
                lps = [sampled.logprobs[g.first + j] for j in range(len(tokens))]
            if fail is None:
                fail = errors.get(g.req_id)
            if fail is None and st.grammar is not None:
                fail = _advance_grammar(st, tokens)
            if fail is not None:  # no token left by its masks, or its grammar failed
                out.failed[g.req_id] = fail
                continue
            st.token_ids.extend(tokens)
            out.req_ids.append(g.req_id)
            out.sampled_token_ids.append(tokens)
            all_lps.append(lps if st.params.logprobs is not None else None)
        if any(lp is not None for lp in all_lps):
            out.logprobs = all_lps
        self._forced_tokens(out)

    def _verify_bitmask(self, groups: list[RowGroup], states, shape) -> tuple[Any, list[bool]]:
        """The grammar mask of every verified position, and which rows it constrains."""
        if not any(st.grammar is not None for st in states):
            return None, [False] * shape[0]
        if self._grammar_executor is None:
            import llguidance

            self._grammar_executor = llguidance.LLExecutor()
        return verify_bitmask(
            self._grammar_executor,
            [(g.first, st.grammar, g.drafts) for g, st in zip(groups, states, strict=True)],
            shape[0],
            shape[1],
            self.eos_token_ids,
        )

    def _forced_tokens(self, out: RunnerOutput) -> None:
        """With speculation on, a constrained request's next tokens that its grammar forces
        are proposed for its next step (they replace any other proposal: they are sure)."""
        spec = self.speculative
        if spec is None or not spec.grammar_fast_forward:
            return
        for rid in out.req_ids:
            ff = forced_tokens(self.states[rid].grammar, spec.num_speculative_tokens)
            if ff:
                out.draft_token_ids[rid] = ff

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.graph_runner is not None and self.graph_runner.can_run(inputs):
            return self.graph_runner.run(inputs)  # a static buffer: used before next step
        self.backend.begin_step(inputs.attn_metadata)
        ctx = ForwardContext(inputs.attn_metadata, self.kv_caches, self.backend)
        return self.model(inputs.input_ids, inputs.positions, ctx)

    def _sampling_row(
        self, st: CachedRequestState, drafts: list[int] | None = None, grammar: bool | None = None
    ) -> SamplingRow:
        """The sampler's view of one request at its next position, or, with `drafts`, at
        the position after those proposals (speculative decoding): penalties count them,
        min_tokens counts them as outputs, a seeded draw is that position's. Its token ids
        (the state's own list, not a copy) only when a penalty reads them."""
        params = st.params
        num_out = len(st.token_ids) - st.num_prompt_tokens
        tokens = st.token_ids
        if drafts:
            num_out += len(drafts)
            tokens = [*tokens, *drafts] if params.needs_penalties else tokens
        return SamplingRow(
            params,
            tokens if params.needs_penalties else (),
            st.num_prompt_tokens,
            num_out,
            st.generator,
            () if params.ignore_eos else self.eos_token_ids,
            grammar=(st.grammar is not None and st.grammar.active) if grammar is None else grammar,
            position_seed=None if params.seed is None else position_seed(params.seed, num_out),
        )

    def _grammar_bitmask(self, states: list[CachedRequestState], vocab: int):
        """The step's [N, ceil(V / 32)] grammar bitmask, or None when no row is constrained."""
        active = [
            (i, st.grammar) for i, st in enumerate(states) if st.grammar and st.grammar.active
        ]
        if not active:
            return None
        if self._grammar_executor is None:
            import llguidance

            self._grammar_executor = llguidance.LLExecutor()
        grammar = active[0][1].grammar
        mask = fill_bitmask(
            self._grammar_executor,
            [(i, g.matcher) for i, g in active],
            len(states),
            vocab,
            grammar.eos_token_id,
            self.eos_token_ids,
        )
        for i, g in active:  # an optional reasoning section may still open
            g.widen(mask[i])
        return mask

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor, out: RunnerOutput):
        """Logprobs of each scored prompt token, PROMPT_LOGPROBS_CHUNK rows of logits at a
        time: an 8,192-token chunk of a 128k vocabulary would be 4 GB of float32 at once."""
        for rid, row0, pos0, count in inputs.prompt_logprob_spans:
            st = self.states[rid]
            entries = []
            for start in range(0, count, PROMPT_LOGPROBS_CHUNK):
                n = min(PROMPT_LOGPROBS_CHUNK, count - start)
                logits = self.model.compute_logits(hidden[row0 + start : row0 + start + n])
                if logits is None:  # a tensor-parallel worker: rank 0 scores the prompt
                    continue
                first = pos0 + 1 + start
                targets = torch.tensor(st.token_ids[first : first + n], device=self.device)
                entries += compute_prompt_logprobs(logits, targets, st.params.prompt_logprobs or 0)
            out.prompt_logprobs[rid] = PromptLogprobsChunk(pos0, entries)


def _sample_hidden(hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
    """The hidden states of the rows that sample, [len(sample_rows), H].

    A decode-only step samples every row, in order: a view, no gather. Otherwise
    `index_select`: advanced indexing (`hidden[rows]`) took 4 ms for 64 rows of 512 on two
    shared cores, where index_select takes 8 µs."""
    rows = inputs.sample_rows
    if len(rows) == inputs.attn_metadata.num_tokens:  # rows are increasing: 0..T-1 exactly
        return hidden[: len(rows)]
    return hidden.index_select(0, torch.tensor(rows, device=hidden.device))


def _grammar_error(st: CachedRequestState) -> str | None:
    """`structured_outputs.<kind>: ...` when the request's grammar is in its error state."""
    why = st.grammar.error() if st.grammar is not None else None
    if why is None:
        return None
    return f"structured_outputs.{st.grammar.grammar.kind}: the grammar engine stopped: {why}"


def _advance_grammar(st: CachedRequestState, tokens: list[int]) -> str | None:
    """Advances the request's grammar by the step's accepted tokens; the error when a limit
    is hit taking one of them (the step's tokens are then not emitted)."""
    for tok in tokens:
        st.grammar.advance(tok)
        if (why := _grammar_error(st)) is not None:
            return why
    return None


def _grammar_state(
    grammar: object | None, params, output_token_ids: list[int]
) -> GrammarState | None:
    """A fresh matcher for a request the runner has not seen (new, forked, or resumed after
    preemption by recompute: its output tokens are replayed)."""
    if grammar is None:
        return None
    assert isinstance(grammar, CompiledGrammar)
    so = params.structured_outputs
    return GrammarState(
        grammar,
        so.start_after if so is not None else None,
        output_token_ids,
        optional=so is not None and so.opened_by is not None,
    )
