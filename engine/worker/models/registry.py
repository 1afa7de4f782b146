"""Model classes by the checkpoint's `architectures` name."""

from __future__ import annotations

from engine.worker.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from engine.worker.models.qwen3 import Qwen3ForCausalLM

_MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def get_model_class(architectures: list[str] | None) -> type:
    """The first supported class among `architectures`; ValueError naming the supported ones."""
    for arch in architectures or []:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported model architecture {list(architectures or [])}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
