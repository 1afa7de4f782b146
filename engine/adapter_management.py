"""LoRA adapters held by an engine: loading, listing, removing while requests still run.

`AdapterManagement` is a part of `LLMEngine` (engine/llm_engine.py), kept in its own module
because it is a job of its own: the adapters live in a host-memory registry
(`engine.worker.lora.registry`, thread-safe: files are read on the caller's thread); a
removal refuses new requests for the adapter at once and drops it only when the last
request using it leaves, which the engine checks after every step
(`_settle_lora_removals`). It reads the engine's registry and scheduler, declared below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import LoRAError
from engine.lora_request import LoRARequest

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler
    from engine.worker.lora.registry import LoRARegistry

__all__ = ["AdapterManagement"]


class AdapterManagement:
    """The engine's LoRA adapter calls (a mixin of `LLMEngine`)."""

    # The engine's state this part reads (set in `LLMEngine._build`; `loras` None: LoRA off).
    loras: LoRARegistry | None
    scheduler: Scheduler

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
