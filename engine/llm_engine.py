"""LLMEngine: add requests, step, abort. The one object that owns scheduler, runner and model.

One `step()` is: schedule -> execute on the model -> update the scheduler with the sampled
tokens -> detokenize and check stop strings -> one `RequestDelta` per request that progressed
(only what is new; see `engine.output.request_output`). `prepare_request` is pure
validation and tokenization and may run on another thread than `step`; everything else
belongs to the thread that steps, except the LoRA calls that say otherwise.

Embedding models (`task` "embed", see engine/worker/pooling/): `prepare_request` takes
`PoolingParams` instead of `SamplingParams`; such a request is prefill-only and its last
delta carries the vector (`RequestDelta.embedding`). A request of the other kind than the
model's task is refused with an InvalidRequestError naming the task.

LoRA (`lora.enabled`): `add_lora` reads and checks an adapter into the host-memory cache
(`engine.worker.lora.registry`, thread-safe: files are read on the caller's thread), a
request names its adapter with `lora_request` (loaded on first use), `remove_lora` refuses
new requests for it at once and drops it when its last request leaves.

Its parts, one job to a module: request_preparation.py (`prepare_request`, thread-safe) and
adapter_management.py (the LoRA calls) are mixins of `LLMEngine` over its state.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from engine.adapter_management import AdapterManagement
from engine.config import ConfigError, EngineConfig
from engine.core import admission
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.kv_tier.manager import KVTierManager, KVTierStats
from engine.core.policy.policy import TenantStats
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.spec.stats import SpecDecodeStats
from engine.core.step_io import SchedulerOutput
from engine.output.processor import OutputProcessor
from engine.output.request_output import RequestDelta, SampleError
from engine.output.tokenizer import Tokenizer
from engine.pooling_params import PoolingParams
from engine.request_preparation import PreparedRequest, RequestPreparation
from engine.sampling_params import SamplingParams
from engine.speculative import build_speculator, load_draft_model
from engine.worker.attention.kv_dtype import kv_cache_dtype
from engine.worker.distributed.group import threads_per_rank
from engine.worker.distributed.pool import WorkerPool
from engine.worker.host_malloc import keep_freed_memory
from engine.worker.kv_sizing import KVGeometry, size_kv_cache
from engine.worker.kv_tier.setup import (
    RankTiers,
    open_disk_store,
    plan_kv_tiers,
    start_kv_tiers,
)
from engine.worker.lora.model_lora import check_lora_runtime
from engine.worker.lora.registry import LoRARegistry
from engine.worker.models.loader import load_model, resolve_max_model_len
from engine.worker.models.parallel import TensorParallel
from engine.worker.pooling.spec import embedding_max_len
from engine.worker.quant.fp8 import check_kv_dtype
from engine.worker.runner import ModelRunner
from engine.worker.structured.compiler import CompiledGrammar, GrammarCompiler

logger = logging.getLogger(__name__)

# Seconds an empty step (only KV tier moves in flight) waits for one of them to finish.
EMPTY_STEP_WAIT_S = 0.005


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # LoRA adapter name -> requests (samples) running / waiting with it; empty without LoRA.
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)
    # Speculative decoding's counters; None when it is off.
    spec_decode: SpecDecodeStats | None = None
    # The KV tiers' counters and gauges (engine.core.kv_tier.KVTierStats); None without.
    kv_tier: KVTierStats | None = None
    # Tenant name -> its running and waiting requests and virtual token counter; empty
    # while only the default tenant was seen under fcfs / priority.
    tenants: dict[str, TenantStats] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("runtime.device", f"{name!r} requested but CUDA is not available")
    return torch.device(name)


class LLMEngine(RequestPreparation, AdapterManagement):
    def __init__(self, config: EngineConfig):
        self.config = config
        rt = config.runtime
        tp_size = config.parallel.tensor_parallel_size
        threads = threads_per_rank(rt, tp_size)
        if threads is not None:
            torch.set_num_threads(threads)
        torch.manual_seed(config.model.seed)
        self.device = resolve_device(rt.device)
        check_lora_runtime(config, self.device)
        check_kv_dtype(config.cache.kv_dtype, self.device)
        t0 = time.perf_counter()
        # Tensor parallelism: this process is rank 0 (scheduler, sampler, its own shard);
        # the pool holds ranks 1.. (None at size 1). See engine/worker/distributed/.
        self.tp_workers = WorkerPool.start(config, self.device) if tp_size > 1 else None
        try:
            self._build(t0)
        except BaseException as e:
            if self.tp_workers is None:
                raise
            cause = e if isinstance(e, ConfigError) else self.tp_workers.explain_start_failure(e)
            self.tp_workers.close()
            if cause is e:
                raise
            raise cause from e
        if self.tp_workers is not None:
            # Workers outlive nothing: a dropped engine stops them too.
            weakref.finalize(self, self.tp_workers.close)

    def _build(self, t0: float) -> None:
        config, rt = self.config, self.config.runtime
        tp = self.tp_workers.tp if self.tp_workers is not None else TensorParallel()
        loaded = load_model(config.model, self.device, tp)
        if self.tp_workers is not None:
            self.tp_workers.await_loaded()
        self.hf_config = loaded.hf_config
        self.model_dir = loaded.model_dir
        # generate | embed; `pooling` is the embedding model's pooling (None: generation).
        self.task = loaded.task
        self.pooling = loaded.pooling
        if self.task == "embed" and config.lora.enabled:
            raise ConfigError("lora.enabled", "LoRA adapters are not served on embedding models")
        self.tokenizer = Tokenizer.from_pretrained(loaded.model_dir)
        model = loaded.model
        self.vocab_size = model.vocab_size
        self.model_name = config.model.served_name or _default_served_name(config, loaded)
        self.max_model_len = embedding_max_len(
            config.model, resolve_max_model_len(config.model, loaded.hf_config), self.pooling
        )
        block_size = config.cache.block_size
        kv_dtype = kv_cache_dtype(config.cache.kv_dtype, loaded.dtype)
        self.runner = ModelRunner(
            model,
            self.device,
            loaded.dtype,
            block_size,
            rt,
            eos_token_ids=self.tokenizer.eos_token_ids,
            lora=config.lora,
            speculative=config.speculative,
            pooling=self.pooling,
            kv_dtype=kv_dtype,
        )
        if config.speculative.method == "draft":
            self.runner.proposer = load_draft_model(
                config, model, self.tokenizer, self.device, block_size
            )
        lora = self.runner.lora
        # The adapters in host memory; None when LoRA is off.
        self.loras = (
            LoRARegistry(lora.shapes, config.lora, lora.dtype) if lora is not None else None
        )
        geom = KVGeometry.of(model, block_size, kv_dtype)  # fp8 pages: 1 byte an element
        if self.runner.proposer is not None:  # a draft model's KV shares the block ids
            geom = replace(geom, extra_bytes_per_block=self.runner.proposer.kv_bytes_per_block)
        num_blocks = size_kv_cache(self.runner, config, geom, self.max_model_len, tp)
        tiers = plan_kv_tiers(config.cache, geom.bytes_per_block, self.device, tp.size)
        if tiers.extra_pool_blocks:  # the CPU's host_tier_gib: a larger pool (see setup.py)
            logger.info(
                "cache.host_tier_gib on the CPU: %d more KV pool blocks (docs/kv_tiers.md)",
                tiers.extra_pool_blocks,
            )
            num_blocks += tiers.extra_pool_blocks
        disk = None
        if tiers.disk_dir is not None:  # probed before the cache is allocated: fail fast
            disk = open_disk_store(
                config, tiers, loaded.model_dir, loaded.dtype,
                (geom.num_layers, geom.num_kv_heads, geom.head_dim),
            )  # fmt: skip
        self.runner.allocate_kv_cache(num_blocks)
        if self.device.type == "cpu":  # loaded: from here on, keep freed memory for the steps
            keep_freed_memory(rt.malloc_keep_mib)
        if self.tp_workers is not None:
            self.tp_workers.await_ready(num_blocks)
        self.runner.capture_graphs(config.scheduler.max_num_seqs, self.max_model_len)
        # Attention backend and decode graphs as they ended up, with any fallback's reason.
        self.accelerator = self.runner.status
        self.kv_manager = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        # KV tiers (docs/kv_tiers.md): the core's decisions and the worker's threads.
        self.kv_tier: KVTierManager | None = None
        self.kv_tier_worker = None
        if tiers.host_slots or disk is not None:
            ranks = None
            if self.tp_workers is not None:  # every rank moves its share of each block
                ranks = RankTiers(self.tp_workers.tier_listings, self.tp_workers.tier_conns)
            self.kv_tier, self.kv_tier_worker = start_kv_tiers(
                tiers, self.kv_manager, self.runner.kv_caches, self.device, disk,
                config.cache.disk_tier_rescan_s, ranks,
            )  # fmt: skip
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_manager,
            self.max_model_len,
            max_loras=config.lora.max_loras if lora is not None else None,
            speculator=build_speculator(config.speculative),
            kv_tier=self.kv_tier,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        # Structured outputs: grammars compiled in prepare_request (off the engine thread).
        so = config.structured_outputs
        self.grammars = GrammarCompiler(
            self.tokenizer.hf, self.vocab_size, self.tokenizer.eos_token_ids,
            cache_bytes=so.cache_mib << 20, max_grammar_bytes=so.max_grammar_mib << 20,
        )  # fmt: skip
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        # The SchedulerOutput of the step being run, until it returns: after an exception,
        # `fail_step` fails exactly the requests that were in it.
        self._step_output: SchedulerOutput | None = None
        logger.info(
            "engine ready model=%s task=%s device=%s dtype=%s kv_dtype=%s kv_blocks=%d "
            "block_size=%d max_model_len=%d attention=%s decode_graphs=%s tensor_parallel=%d "
            "load_s=%.1f",
            self.model_name, self.task, self.device, loaded.dtype, kv_dtype, num_blocks, block_size,
            self.max_model_len, self.accelerator.attention_backend,
            self.accelerator.decode_graphs, tp.size, time.perf_counter() - t0,
        )  # fmt: skip

    # ---- lifetime -------------------------------------------------------------------------
    @property
    def fatal_error(self) -> str | None:
        """Why this engine can never run another step (a tensor-parallel worker died or
        hung), else None. Read from any thread: it turns health red while idle too."""
        return self.tp_workers.fatal if self.tp_workers is not None else None

    def close(self) -> None:
        """Stops the tensor-parallel workers and the KV tier's threads. Idempotent."""
        if self.tp_workers is not None:
            self.tp_workers.close()
        if self.kv_tier_worker is not None:
            self.kv_tier_worker.close()

    def flush_kv_tier(self, timeout_s: float) -> int:
        """Drain, once no step runs any more: writes the pool's cached blocks the disk tier
        lacks, the most recently used first, for at most `timeout_s` seconds, so a restart
        on the same directory finds them. Returns the blocks written (0 without a disk)."""
        tier, worker = self.kv_tier, self.kv_tier_worker
        if tier is None or worker is None or tier.disk is None:
            return 0
        deadline = time.monotonic() + max(0.0, timeout_s)
        before = tier.stats().bytes_written.get("disk", 0)
        queued = tier.flush_pool()
        while tier.busy:
            self._submit_moves(*tier.take_moves())
            left = deadline - time.monotonic()
            if left <= 0:
                break
            report = worker.poll(wait_s=min(left, 0.05))
            if report is not None:
                tier.apply(report)
        written = (tier.stats().bytes_written.get("disk", 0) - before) // max(
            1, tier.sizes.disk_file_bytes
        )
        logger.info(
            "kv disk tier flushed blocks=%d of %d queued complete=%s",
            written, queued, not tier.busy,
        )  # fmt: skip
        return written

    def _submit_moves(self, saves: list, loads: list, deletes: list) -> None:
        """Tier moves outside a step (the drain's flush). Under tensor parallelism every
        rank must carry them out on its share: they go to the workers as a step that
        computes nothing."""
        worker = self.kv_tier_worker
        assert worker is not None
        worker.submit(saves, loads, deletes)
        if self.tp_workers is not None:
            so = SchedulerOutput(kv_saves=saves, kv_loads=loads, kv_deletes=deletes)
            self.tp_workers.run_step(self.runner.execute, so)

    @property
    def embedding_size(self) -> int | None:
        """The width of this model's embeddings (None: a generation model)."""
        return self.pooling.hidden_size if self.pooling is not None else None

    # ---- requests -------------------------------------------------------------------------
    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Engine thread only. Raises InvalidRequestError for an id already held and
        QueueFullError when the waiting queue is full (`engine.core.admission`); a request
        with n samples is queued whole or not at all."""
        admission.check_new_id(prepared.request_id, self.outputs.groups)
        lora = prepared.requests[0].lora_request
        if lora is not None:  # removed while this request was on its way: refused
            self._lora_registry().check_admit(lora.lora_name, prepared.lora_epoch)
        added = []
        try:
            for req in prepared.requests:
                self.scheduler.add_request(req)
                added.append(req)
        except Exception:
            for req in added:
                self.scheduler.abort(req.request_id)
            raise
        self.outputs.add_group(prepared.request_id, prepared.prompt, prepared.requests)
        self._prompt_tokens_total += len(prepared.prompt_token_ids)

    def add_request(
        self, request_id: str, prompt, params: SamplingParams | PoolingParams, **kw
    ) -> None:
        self.add_prepared(self.prepare_request(request_id, prompt, params, **kw))

    def abort(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            for cid in self.outputs.child_ids(rid):
                self.scheduler.abort(cid)
            self.outputs.remove_group(rid)
        self._settle_lora_removals()

    def has_unfinished_requests(self) -> bool:
        """True while a request is held, or KV tier moves are in flight: their blocks come
        back to the pool, and the tier's index learns what was stored, only in a step."""
        if self.scheduler.has_unfinished_requests() or self.scheduler.has_kv_moves():
            return True
        return self.kv_tier_worker is not None and self.kv_tier_worker.has_report()

    def set_wakeup(self, wake) -> None:
        """`wake()` is called from another thread when background work (a KV tier rescan
        that found other replicas' files) waits for a step; the engine loop then steps."""
        if self.kv_tier_worker is not None:
            self.kv_tier_worker.on_scan = wake

    # ---- stepping -------------------------------------------------------------------------
    def has_request(self, request_id: str) -> bool:
        """True while the request (any of its samples) is held by the engine."""
        return request_id in self.outputs.groups

    def step(self) -> list[RequestDelta]:
        """Runs one step; returns what each request that progressed gained in it."""
        self._step_output = None
        tier = self.kv_tier_worker
        if tier is not None:  # what finished since the last step, before the lookups
            report = tier.poll()
            if report is not None:
                self.scheduler.apply_kv_report(report)
        so = self._step_output = self.scheduler.schedule()
        if tier is not None:  # off the engine thread: returns at once
            tier.submit(so.kv_saves, so.kv_loads, so.kv_deletes)
        if self.tp_workers is None:
            runner_out = self.runner.execute(so)
        else:  # every rank runs the step; rank 0's runner samples
            runner_out = self.tp_workers.run_step(self.runner.execute, so)
        if tier is not None:  # an empty step waits a little for loads instead of spinning
            runner_out.kv_tier = tier.poll(EMPTY_STEP_WAIT_S if so.is_empty else 0.0)
        updated = self.scheduler.update_from_output(so, runner_out)
        self._generation_tokens_total += sum(len(t) for t in runner_out.sampled_token_ids)
        touched, stops = self.outputs.process(updated, runner_out)
        for sample, stop, num_output_tokens in stops:
            self.scheduler.stop_on_string(sample, stop, num_output_tokens)
            self.outputs.finalize_stop(sample.request_id)
        for rid, reason in runner_out.failed.items():  # its grammar or masks cannot go on
            gid = self._fail_sample(rid, reason)
            if gid is not None and gid not in touched:
                touched.append(gid)
        results = []
        for gid in touched:
            delta = self.outputs.delta_for(gid)
            if delta is None:
                continue
            results.append(delta)
            if delta.finished:
                self.outputs.remove_group(gid)
        results += self._fail_dropped()
        self._step_output = None
        self._settle_lora_removals()
        return results

    def _fail_dropped(self) -> list[RequestDelta]:
        """The requests the scheduler ended itself (a deadline passed, pushed out of a full
        queue): each one's whole group fails with the error its caller gets
        (`RequestDelta.error_type`). Taken once the step succeeded: after a failed step
        they are still there for the next one."""
        results = []
        for req, err in self.scheduler.take_dropped():
            gid = self.outputs.parent_of.get(req.request_id)
            if gid not in self.outputs.groups:  # aborted meanwhile, or a sibling's group
                continue
            for delta in self._fail_groups([gid], str(err)):
                delta.error_type = type(err)
                results.append(delta)
        return results

    def fail_step(self, message: str) -> list[RequestDelta]:
        """After `step` raised: fail the requests that were in that step and free their
        blocks; requests not in it keep their place. If scheduling itself raised, nothing
        is known, so everything fails."""
        so, self._step_output = self._step_output, None
        if so is None:
            return self.fail_all(message)
        in_step = set(so.num_scheduled_tokens)
        gids = [
            gid
            for gid, group in self.outputs.groups.items()
            if any(s.request.request_id in in_step for s in group.samples)
        ]
        return self._fail_groups(gids, message)

    def fail_all(self, message: str) -> list[RequestDelta]:
        """Fails every in-flight request and frees its blocks; the engine carries on."""
        return self._fail_groups(list(self.outputs.groups), message)

    def _fail_sample(self, sample_id: str, message: str) -> str | None:
        """Ends one sample whose own constraints cannot be followed (the runner's report):
        `finish_reason` "error" with a `SampleError` naming the field, its siblings (n > 1)
        untouched. Returns its group's id, None if the engine no longer holds it."""
        finished = self.scheduler.finish_requests(sample_id, RequestStatus.FINISHED_ERROR)
        if not finished:
            return None
        return self.outputs.fail_sample(sample_id, SampleError(message, _failed_param(finished[0])))

    def _fail_groups(self, gids: list[str], message: str) -> list[RequestDelta]:
        results = []
        for gid in gids:
            group = self.outputs.groups[gid]
            ids = [s.request.request_id for s in group.samples if not s.request.is_finished]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            group.error = message
            results.append(group.take_delta())
            self.outputs.remove_group(gid)
        self._settle_lora_removals()
        return results

    def stats(self) -> EngineStats:
        kv = self.kv_manager.stats()
        lora_running, lora_waiting = (
            self.scheduler.adapter_counts() if self.loras is not None else ({}, {})
        )
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=kv.usage,
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            lora_running=lora_running,
            lora_waiting=lora_waiting,
            spec_decode=(
                self.scheduler.speculator.stats.snapshot()
                if self.scheduler.speculator is not None
                else None
            ),
            kv_tier=self.kv_tier.stats() if self.kv_tier is not None else None,
            tenants=self.scheduler.tenant_stats(),
        )


def _failed_param(req: Request) -> str | None:
    """The request field a sample's own failure is about: its grammar when it has one (the
    grammar is then among the masks that left no token), else the mask that did."""
    grammar = req.grammar
    if isinstance(grammar, CompiledGrammar):
        return f"structured_outputs.{grammar.kind}"
    p = req.sampling_params
    return "allowed_token_ids" if p.allowed_token_ids is not None else "min_tokens"


def _default_served_name(config: EngineConfig, loaded) -> str:
    if config.model.path is None:
        return "SmolLM2-135M-Instruct"
    return config.model.path.rstrip("/").split("/")[-1]
