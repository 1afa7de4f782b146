"""LLMEngine: add requests, step, abort. The one object that owns scheduler, runner and model.

One `step()` is: schedule -> execute on the model -> update the scheduler with the sampled
tokens -> detokenize and check stop strings -> one `RequestDelta` per request that progressed
(only what is new; see `engine.output.request_output`). `prepare_request` is pure
validation and tokenization and may run on another thread than `step`; everything else
belongs to the thread that steps, except the LoRA calls that say otherwise.

LoRA (`lora.enabled`): `add_lora` reads and checks an adapter into the host-memory cache
(`engine.worker.lora.registry`, thread-safe: files are read on the caller's thread), a
request names its adapter with `lora_request` (loaded on first use), `remove_lora` refuses
new requests for it at once and drops it when its last request leaves.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from engine.config import ConfigError, EngineConfig
from engine.core import admission
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.policy.policy import TenantStats
from engine.core.policy.tenant import Tenant
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.step_io import SchedulerOutput
from engine.errors import InvalidRequestError, LoRAError
from engine.lora_request import LoRARequest
from engine.output.processor import OutputProcessor
from engine.output.request_output import RequestDelta
from engine.output.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams
from engine.worker.distributed.group import threads_per_rank
from engine.worker.distributed.pool import WorkerPool
from engine.worker.kv_sizing import KVGeometry, size_kv_cache
from engine.worker.lora.model_lora import check_lora_runtime
from engine.worker.lora.registry import LoRARegistry
from engine.worker.models.loader import load_model, resolve_max_model_len
from engine.worker.models.parallel import TensorParallel
from engine.worker.runner import ModelRunner
from engine.worker.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    requests: list[Request]  # one per sample (n)
    # Its LoRA adapter's removal count when prepared: a removal since refuses it when added.
    lora_epoch: int = 0


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
    # Tenant name -> its running and waiting requests and virtual token counter; empty
    # while only the default tenant was seen under fcfs / priority.
    tenants: dict[str, TenantStats] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("runtime.device", f"{name!r} requested but CUDA is not available")
    return torch.device(name)


class LLMEngine:
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
        self.tokenizer = Tokenizer.from_pretrained(loaded.model_dir)
        model = loaded.model
        self.vocab_size = model.vocab_size
        self.model_name = config.model.served_name or _default_served_name(config, loaded)
        self.max_model_len = resolve_max_model_len(config.model, loaded.hf_config)
        block_size = config.cache.block_size
        self.runner = ModelRunner(
            model,
            self.device,
            loaded.dtype,
            block_size,
            rt,
            eos_token_ids=self.tokenizer.eos_token_ids,
            lora=config.lora,
        )
        lora = self.runner.lora
        # The adapters in host memory; None when LoRA is off.
        self.loras = (
            LoRARegistry(lora.shapes, config.lora, lora.dtype) if lora is not None else None
        )
        geom = KVGeometry.of(model, block_size, loaded.dtype)
        num_blocks = size_kv_cache(self.runner, config, geom, self.max_model_len, tp)
        self.runner.allocate_kv_cache(num_blocks)
        if self.tp_workers is not None:
            self.tp_workers.await_ready(num_blocks)
        self.runner.capture_graphs(config.scheduler.max_num_seqs, self.max_model_len)
        # Attention backend and decode graphs as they ended up, with any fallback's reason.
        self.accelerator = self.runner.status
        self.kv_manager = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_manager,
            self.max_model_len,
            max_loras=config.lora.max_loras if lora is not None else None,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        # Structured outputs: grammars compiled in prepare_request (off the engine thread).
        self.grammars = GrammarCompiler(
            self.tokenizer.hf, self.vocab_size, self.tokenizer.eos_token_ids
        )
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        # The SchedulerOutput of the step being run, until it returns: after an exception,
        # `fail_step` fails exactly the requests that were in it.
        self._step_output: SchedulerOutput | None = None
        logger.info(
            "engine ready model=%s device=%s dtype=%s kv_blocks=%d block_size=%d "
            "max_model_len=%d attention=%s decode_graphs=%s tensor_parallel=%d load_s=%.1f",
            self.model_name, self.device, loaded.dtype, num_blocks, block_size,
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
        """Stops the tensor-parallel workers (a no-op on one device). Idempotent."""
        if self.tp_workers is not None:
            self.tp_workers.close()

    # ---- requests -------------------------------------------------------------------------
    def prepare_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | tuple[str, ...] | None = None,
        lora_request: LoRARequest | None = None,
        tenant: Tenant | None = None,
        deadline: float | None = None,
    ) -> PreparedRequest:
        """Validates and tokenizes; raises InvalidRequestError naming the field. Thread-safe.
        A `lora_request` not loaded yet is read from its directory here (LoRAError if bad).
        `tenant`: whose share it runs on (None: the default tenant); `deadline`: the
        time.monotonic() by which it must finish (None: none), see engine/core/policy."""
        lora, epoch = None, 0
        if lora_request is not None:
            lora, epoch = self._lora_registry().acquire(lora_request)
        text, ids = self.tokenize_prompt(prompt)
        if params.n > self.config.scheduler.max_n:
            raise InvalidRequestError(
                f"n must be at most {self.config.scheduler.max_n}, got {params.n}", "n"
            )
        admission.check_stop_limits(params, self.config.scheduler)
        params.validate_vocab(self.vocab_size)  # SamplingParamsError is an InvalidRequestError
        params.validate_masks(self.tokenizer.eos_token_ids)
        so = params.structured_outputs
        grammar = self.grammars.compile(so) if so is not None else None
        kv = self.kv_manager
        max_tokens = admission.fit_lengths(
            len(ids), params.max_tokens, self.max_model_len, kv.block_size, kv.num_blocks
        )
        eos = frozenset(self.tokenizer.eos_token_ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        requests = []
        for i in range(params.n):
            p = params
            if params.n > 1:
                # The group's prompt logprobs come from its first sample alone: another one
                # prefills the prompt itself when the first finished before it could fork.
                p = replace(
                    p,
                    n=1,
                    seed=None if params.seed is None else _int64(params.seed + i),
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            requests.append(
                Request(
                    rid, ids, p, eos_token_ids=eos, arrival_time=arrival,
                    priority=priority, cache_salt=cache_salt,
                    fork_from=None if i == 0 else requests[0].request_id, max_tokens=max_tokens,
                    grammar=grammar, lora_request=lora_request,
                    lora_key=None if lora is None else lora.key, lora=lora,
                    tenant=tenant, deadline=deadline,
                )
            )  # fmt: skip
        return PreparedRequest(request_id, text, ids, requests, epoch)

    def tokenize_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids); raises InvalidRequestError. Thread-safe."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError(
                    "prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt"
                )
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})",
                    "prompt",
                )
        if not ids:
            raise InvalidRequestError("prompt must contain at least one token", "prompt")
        return text, ids

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

    def add_request(self, request_id: str, prompt, params: SamplingParams, **kw) -> None:
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
        return self.scheduler.has_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------------
    def has_request(self, request_id: str) -> bool:
        """True while the request (any of its samples) is held by the engine."""
        return request_id in self.outputs.groups

    def step(self) -> list[RequestDelta]:
        """Runs one step; returns what each request that progressed gained in it."""
        self._step_output = None
        so = self._step_output = self.scheduler.schedule()
        if self.tp_workers is None:
            runner_out = self.runner.execute(so)
        else:  # every rank runs the step; rank 0's runner samples
            runner_out = self.tp_workers.run_step(self.runner.execute, so)
        updated = self.scheduler.update_from_output(so, runner_out)
        self._generation_tokens_total += sum(len(t) for t in runner_out.sampled_token_ids)
        touched, stops = self.outputs.process(updated, runner_out)
        for sample, stop in stops:
            self.scheduler.stop_on_string(sample, stop)
            self.outputs.finalize_stop(sample.request_id)
        results = []
        for rid, reason in runner_out.failed.items():  # its masks left no token to sample
            gid = self.outputs.parent_of.get(rid)
            if gid in self.outputs.groups:
                results += self._fail_groups([gid], reason, request_error=True)
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

    def _fail_groups(
        self, gids: list[str], message: str, request_error: bool = False
    ) -> list[RequestDelta]:
        results = []
        for gid in gids:
            group = self.outputs.groups[gid]
            ids = [s.request.request_id for s in group.samples if not s.request.is_finished]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            group.error, group.error_is_request = message, request_error
            results.append(group.take_delta())
            self.outputs.remove_group(gid)
        self._settle_lora_removals()
        return results

    # ---- LoRA adapters --------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> None:
        """Reads and checks the adapter into host memory (LoRAError naming the problem).
        Loading the same name and path again does nothing. Thread-safe."""
        self._lora_registry().acquire(lora)

    def remove_lora(self, lora_name: str) -> None:
        """Engine thread. New requests for it are refused from now on (LoRAError); requests
        already holding it finish untouched, and it is dropped when the last one leaves
        (`lora_in_use` turns False). LoRANotFoundError when no such adapter is loaded."""
        self._lora_registry().begin_remove(lora_name)
        self._settle_lora_removals()

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded in host memory (not those being removed). Thread-safe."""
        return [] if self.loras is None else self.loras.list()

    def is_lora_loaded(self, lora: LoRARequest) -> bool:
        """True when `lora` is in host memory as given (no file to read for it). Thread-safe."""
        return self.loras is not None and self.loras.is_loaded(lora)

    def lora_in_use(self, lora_name: str) -> bool:
        """Engine thread. True while a request held by the engine runs the adapter."""
        return self.scheduler.uses_adapter(lora_name)

    def _lora_registry(self) -> LoRARegistry:
        if self.loras is None:
            raise LoRAError("LoRA adapters are off: set lora.enabled (LLM(enable_lora=True))")
        return self.loras

    def _settle_lora_removals(self) -> None:
        """Drops the adapters being removed that no request uses any more."""
        if self.loras is None:
            return
        for name in self.loras.draining():
            if not self.scheduler.uses_adapter(name):
                self.loras.finish_remove(name)

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
            tenants=self.scheduler.tenant_stats(),
        )


def _int64(x: int) -> int:
    """x wrapped into int64 (a sample's seed is the request's + its index): the generator
    takes seeds modulo 2**64, so the wrapped seed draws the same numbers."""
    return (x + 2**63) % 2**64 - 2**63


def _default_served_name(config: EngineConfig, loaded) -> str:
    if config.model.path is None:
        return "SmolLM2-135M-Instruct"
    return config.model.path.rstrip("/").split("/")[-1]
