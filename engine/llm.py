"""`LLM`: the offline API, shaped like vLLM's so users already know it.

from engine import LLM, SamplingParams
llm = LLM()                                   # the default model
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
print(out[0].outputs[0].text)

With adapters (PEFT LoRA directories), as in vLLM:

llm = LLM(model, enable_lora=True, max_loras=4, max_lora_rank=16)
llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

Embeddings, with an embedding checkpoint (a sentence-transformers directory, or a bare
decoder such as Qwen3Model; `task="embed"` forces it):

llm = LLM("/models/Qwen3-Embedding-0.6B")
vectors = [o.outputs.embedding for o in llm.embed(["a query", "a document"])]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from engine.beam_search import BeamSearchOutput, run_beam_search
from engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
    speculative_config_from_dict,
)
from engine.llm_engine import LLMEngine
from engine.lora_request import LoRARequest
from engine.output.request_output import (
    EmbeddingRequestOutput,
    OutputAccumulator,
    RequestOutput,
)
from engine.pooling_params import PoolingParams
from engine.sampling_params import BeamSearchParams, SamplingParams

# LLM(...) keyword -> (config section, field name)
_OVERRIDES = {
    "dtype": ("model", "dtype"),
    "max_model_len": ("model", "max_model_len"),
    "seed": ("model", "seed"),
    "task": ("model", "task"),
    "pooling": ("model", "pooling"),
    "normalize": ("model", "normalize"),
    "is_matryoshka": ("model", "is_matryoshka"),
    "served_model_name": ("model", "served_name"),
    "tokenizer": ("model", "tokenizer"),
    "quantization": ("model", "quantization"),
    "quantization_group": ("model", "quantization_group"),
    "quant_activations": ("model", "quant_activations"),
    "kv_cache_dtype": ("cache", "kv_dtype"),
    "block_size": ("cache", "block_size"),
    "num_kv_blocks": ("cache", "num_kv_blocks"),
    "kv_cache_gib": ("cache", "cpu_kv_cache_gib"),
    "memory_fraction": ("cache", "memory_fraction"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "host_tier_gib": ("cache", "host_tier_gib"),
    "disk_tier_dir": ("cache", "disk_tier_dir"),
    "disk_tier_gib": ("cache", "disk_tier_gib"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "scheduling_policy": ("scheduler", "policy"),
    "max_queue_len": ("scheduler", "max_queue_len"),
    "device": ("runtime", "device"),
    "num_threads": ("runtime", "num_threads"),
    "compile": ("runtime", "compile"),
    "cuda_graphs": ("runtime", "cuda_graphs"),
    "cpu_kernels": ("runtime", "cpu_kernels"),
    "attention_backend": ("runtime", "attention_backend"),
    "malloc_keep_mib": ("runtime", "malloc_keep_mib"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "enable_lora": ("lora", "enabled"),
    "max_loras": ("lora", "max_loras"),
    "max_lora_rank": ("lora", "max_lora_rank"),
    "max_cpu_loras": ("lora", "max_cpu_loras"),
}
_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "runtime": RuntimeConfig,
    "parallel": ParallelConfig,
    "lora": LoRAConfig,
}


def build_engine_config(model: str | None = None, **overrides: Any) -> EngineConfig:
    """`speculative_config`: a `SpeculativeConfig` or a dict in vLLM's spelling (or ours)."""
    speculative = speculative_config_from_dict(overrides.pop("speculative_config", None))
    unknown = sorted(set(overrides) - set(_OVERRIDES))
    if unknown:
        raise TypeError(f"LLM() got unknown arguments {unknown}; known: {sorted(_OVERRIDES)}")
    fields: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    fields["model"]["path"] = model
    for key, value in overrides.items():
        section, name = _OVERRIDES[key]
        fields[section][name] = value
    # With a small scheduler budget the default queue limit would refuse offline batches.
    fields["scheduler"].setdefault("max_queue_len", 1 << 20)
    sections = {name: cls(**fields[name]) for name, cls in _SECTIONS.items()}
    return EngineConfig(**sections, speculative=speculative)


class LLM:
    def __init__(self, model: str | None = None, **overrides: Any):
        config = overrides.pop("config", None) or build_engine_config(model, **overrides)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the tensor-parallel worker processes, if any (also done at exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; results come back in input order.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _broadcast(sampling_params, len(prompts))
        loras = _per_prompt_loras(lora_request, len(prompts))
        pending: dict[str, OutputAccumulator] = {}
        for prompt, p, lora in zip(prompts, params, loras, strict=True):
            rid = str(next(self._ids))
            self.engine.add_request(rid, prompt, p, lora_request=lora)
            pending[rid] = OutputAccumulator(rid, p.n)
        return self._run(pending, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or many; applies the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": self.tokenizer.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, **template_kwargs
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self, prompts: Sequence[str | dict | list[int]], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        return run_beam_search(self.engine, list(prompts), params, self._ids)

    def embed(
        self,
        prompts: str | dict | list[int] | Sequence[str | dict | list[int]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (an embedding model only), in input order. A list
        of ints is one prompt of token ids. `truncate_prompt_tokens` applies to prompts
        whose params leave it unset (vLLM's keyword)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} pooling params for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            params = [
                p if p.truncate_prompt_tokens is not None
                else replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                for p in params
            ]  # fmt: skip
        pending: dict[str, OutputAccumulator] = {}
        for prompt, p in zip(prompts, params, strict=True):
            rid = str(next(self._ids))
            self.engine.add_request(rid, prompt, p)
            pending[rid] = OutputAccumulator(rid, 1)
        return [EmbeddingRequestOutput.of(o) for o in self._run(pending, use_tqdm, "embed")]

    def _run(
        self, pending: dict[str, OutputAccumulator], use_tqdm: bool, desc: str = "generate"
    ) -> list[RequestOutput]:
        """Steps until every request in `pending` finished; each output is built once, then."""
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(pending), desc=desc, disable=not use_tqdm, unit="req")
        try:
            while len(results) < len(pending) and self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    acc = pending.get(delta.request_id)
                    if acc is None:
                        continue
                    acc.add(delta)
                    if delta.finished:
                        results[delta.request_id] = acc.output()
                        bar.update(1)
        finally:
            bar.close()
        return [results[rid] for rid in pending]


def _per_prompt_loras(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    loras = list(lora)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} LoRA requests for {n} prompts")
    return loras


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
