"""Model classes by the checkpoint's `architectures` name.

A bare decoder (`LlamaModel`, `Qwen3Model`, ...: the `model.` part of a causal LM, saved
without its LM head, as sentence-transformers saves embedding models) maps to the same
family class built without an LM head; its weights lack the `model.` prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.worker.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from engine.worker.models.qwen3 import Qwen3ForCausalLM

_MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
_BARE: dict[str, type] = {
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": MistralForCausalLM,
    "Qwen2Model": Qwen2ForCausalLM,
    "Qwen3Model": Qwen3ForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (*_MODELS, *_BARE)


@dataclass(frozen=True)
class Architecture:
    """The checkpoint's architecture as we build it."""

    name: str  # as config.json spells it
    cls: type
    bare: bool  # a decoder without LM head (weights without the `model.` prefix)


def resolve_architecture(architectures: list[str] | None) -> Architecture:
    """The first supported entry of `architectures`; ValueError naming the supported ones."""
    for arch in architectures or []:
        if arch in _MODELS:
            return Architecture(arch, _MODELS[arch], bare=False)
        if arch in _BARE:
            return Architecture(arch, _BARE[arch], bare=True)
    raise ValueError(
        f"unsupported model architecture {list(architectures or [])}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def get_model_class(architectures: list[str] | None) -> type:
    """The class for the first supported entry of `architectures` (see resolve_architecture)."""
    return resolve_architecture(architectures).cls
