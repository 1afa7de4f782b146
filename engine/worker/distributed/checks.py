"""What a tensor-parallel configuration must satisfy; each failure is a ConfigError at start.

Checked on rank 0 before any worker starts, from the checkpoint's config alone, so a bad
size costs no model load and no process."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError, EngineConfig

KEY = "parallel.tensor_parallel_size"


def check_tensor_parallel(
    config: EngineConfig, hf_config: Any, device_type: str, base_index: int, device_count: int
) -> None:
    """Raises ConfigError naming the key that must change for `tensor_parallel_size` ranks.

    `device_type`, `base_index`: rank 0's device ("cuda", index 0 for "cuda"); rank r runs
    on cuda:(base_index + r), so `device_count` (visible GPUs) must cover them."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % size:
        raise ConfigError(KEY, f"{size} does not divide the model's {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        raise ConfigError(
            KEY,
            f"{size} ranks cannot share the model's {kv_heads} KV heads: one of the two must "
            "divide the other",
        )
    inter = hf_config.intermediate_size
    if inter % size:
        raise ConfigError(KEY, f"{size} does not divide the model's intermediate_size {inter}")
    if device_type == "cuda" and base_index + size > device_count:
        raise ConfigError(
            KEY,
            f"{size} ranks need GPUs cuda:{base_index}..cuda:{base_index + size - 1}, but "
            f"{device_count} GPU(s) are visible",
        )
    if config.lora.enabled:
        raise ConfigError("lora.enabled", f"LoRA is not supported with {KEY} > 1 yet")
    if config.runtime.compile:
        raise ConfigError("runtime.compile", f"torch.compile is not supported with {KEY} > 1")
    if device_type == "cuda" and config.runtime.cuda_graphs:
        raise ConfigError(
            "runtime.cuda_graphs",
            f"decode CUDA graphs are not supported with {KEY} > 1; set it to false",
        )
