"""`LoRARequest`: which adapter a request runs with, shaped like vLLM's.

    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

A leaf module (imports nothing of ours): the scheduler's core reads the adapter's id for the
prefix-cache key, the worker loads the weights from `lora_path`, the frontends build one
from a request's `model` field.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique per adapter, and its PEFT directory.

    `allowed_dirs`: real paths of the directories every file read for the adapter must lie
    in, symlinks resolved on the opened file itself (empty: anywhere). The appliance sets it
    for runtime loads (`lora.allowed_dirs`); it is policy, not identity (not compared)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    allowed_dirs: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError("LoRARequest.lora_int_id must be >= 1 (0 is the base model)")
