"""The inference engine, a library: paged KV cache, continuous batching, model execution.

`from engine import LLM, SamplingParams` is the offline API. Heavy modules (torch, models)
load on first use, so `import engine` stays cheap for the torch-free core.
"""

from engine.lora_request import LoRARequest
from engine.pooling_params import PoolingParams
from engine.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "LLMEngine",
    "LoRARequest",
    "PoolingParams",
    "SamplingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "RequestOutput",
    "EmbeddingRequestOutput",
    "Tenant",
]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "Tenant":  # whose share a request runs on (engine/core/policy/tenant.py)
        from engine.core.policy.tenant import Tenant

        return Tenant
    if name in ("RequestOutput", "CompletionOutput", "EmbeddingRequestOutput"):
        from engine.output import request_output

        return getattr(request_output, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
