"""Request preparation: validating and tokenizing a request before the engine takes it.

`RequestPreparation` is a part of `LLMEngine` (engine/llm_engine.py), kept in its own module
because it is a job of its own and runs on another thread: `prepare_request` is pure
validation and tokenization (thread-safe), so the HTTP and gRPC frontends call it on their
own threads and hand the engine thread only a `PreparedRequest`, whose admission
(`LLMEngine.add_prepared`) is then a few dictionary operations. It checks the task, the
sampling or pooling parameters, the adapter, the grammar (compiled here, off the engine
thread) and the KV fit, and expands `n` samples into one `Request` each (forks of the first).
It reads the engine's model facts, declared below; the engine sets them when it is built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.core import admission
from engine.core.policy.tenant import Tenant
from engine.core.request import Request
from engine.errors import InvalidRequestError, LoRAError
from engine.lora_request import LoRARequest
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.kv_cache.manager import KVCacheManager
    from engine.output.tokenizer import Tokenizer
    from engine.worker.lora.registry import LoRARegistry
    from engine.worker.pooling.spec import PoolingSpec
    from engine.worker.structured.compiler import GrammarCompiler

__all__ = ["PreparedRequest", "RequestPreparation"]


@dataclass
class PreparedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    requests: list[Request]  # one per sample (n)
    # Its LoRA adapter's removal count when prepared: a removal since refuses it when added.
    lora_epoch: int = 0


class RequestPreparation:
    """`LLMEngine.prepare_request` and its helpers (a mixin of `LLMEngine`)."""

    # The engine's facts this part reads (set in `LLMEngine._build`).
    config: EngineConfig
    task: str
    model_name: str
    vocab_size: int
    max_model_len: int
    pooling: PoolingSpec | None
    tokenizer: Tokenizer
    grammars: GrammarCompiler
    kv_manager: KVCacheManager
    _lora_registry: Callable[[], LoRARegistry]  # the engine's (LoRA off: LoRAError)

    def prepare_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | PoolingParams,
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
        time.monotonic() by which it must finish (None: none), see engine/core/policy.
        `PoolingParams` make an embedding request (the model's task must be embed)."""
        embed = isinstance(params, PoolingParams)
        admission.check_task(self.task, "embed" if embed else "generate", self.model_name)
        if embed:
            if lora_request is not None:
                raise LoRAError("LoRA adapters are not served on embedding models")
            return self._prepare_embedding(
                request_id, prompt, params, priority, arrival_time, tenant, deadline
            )
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
        if grammar is not None and so.opened_by is not None:  # the tokens that open it
            grammar = replace(grammar, open_token_ids=self.grammars.marker_token_ids(so.opened_by))
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

    def _prepare_embedding(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: PoolingParams,
        priority: int,
        arrival_time: float | None,
        tenant: Tenant | None = None,
        deadline: float | None = None,
    ) -> PreparedRequest:
        """A prefill-only request: tokenized as sentence-transformers does (lower-cased
        first when the checkpoint says so), cut by truncate_prompt_tokens, sized to fit."""
        spec = self.pooling
        assert spec is not None  # check_task passed: this is an embedding model
        spec.check(params)
        if spec.do_lower_case and isinstance(prompt, str):
            prompt = prompt.lower()
        text, ids = self.tokenize_prompt(prompt)
        ids = params.truncate(ids, self.max_model_len)
        kv = self.kv_manager
        admission.fit_prompt(len(ids), self.max_model_len, kv.block_size, kv.num_blocks)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        # Its SamplingParams are the defaults, read by nothing that matters: it never samples.
        request = Request(
            request_id, ids, SamplingParams(max_tokens=1), arrival_time=arrival,
            priority=priority, pooling_params=params, tenant=tenant, deadline=deadline,
        )  # fmt: skip
        return PreparedRequest(request_id, text, ids, [request])

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


def _int64(x: int) -> int:
    """x wrapped into int64 (a sample's seed is the request's + its index): the generator
    takes seeds modulo 2**64, so the wrapped seed draws the same numbers."""
    return (x + 2**63) % 2**64 - 2**63
