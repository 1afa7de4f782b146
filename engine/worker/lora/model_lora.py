"""`ModelLoRA`: the runner's LoRA side, and the start-up rule for what LoRA runs with.

At construction the model's targetable linears are wrapped (`layers.wrap_linears`). Each
step, `order_step` gives each distinct adapter of the step a device slot (`SlotTable`:
resident ones stay, missing ones are copied in over the least recently used) and orders
the requests by slot, so the runner flattens each adapter's rows into one range;
`begin_step` sets the step's `LoRABatch`, which every wrapper reads during the forward, and
`end_step` clears it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from engine.config import ConfigError, EngineConfig, LoRAConfig
from engine.worker.lora.batch import build_lora_batch
from engine.worker.lora.layers import LoRAStep, lora_shapes, wrap_linears
from engine.worker.lora.peft_adapter import LoRAShapes, LoRAWeights
from engine.worker.lora.slots import SlotTable


def check_lora_runtime(config: EngineConfig, device: torch.device) -> None:
    """Refuses, at start, settings LoRA does not run under (ConfigError naming the key):
    the LoRA rows of a step are found per step, which neither a captured CUDA graph nor a
    compiled forward would see."""
    if not config.lora.enabled:
        return
    if config.runtime.compile:
        raise ConfigError(
            "runtime.compile", "torch.compile does not run LoRA adapters; turn one of them off"
        )
    if config.runtime.cuda_graphs and device.type == "cuda":
        raise ConfigError(
            "runtime.cuda_graphs",
            "CUDA graphs do not run LoRA adapters; set runtime.cuda_graphs: false with lora",
        )


class ModelLoRA:
    def __init__(self, model: nn.Module, config: LoRAConfig):
        self.step = LoRAStep()
        self.shapes: LoRAShapes = lora_shapes(model)
        self.wrappers = wrap_linears(model, config.max_loras, config.max_lora_rank, self.step)
        self.slots = SlotTable(config.max_loras)
        # What adapters are read into: the slots' dtype (float32 on the CPU, see layers.py).
        self.dtype = self.wrappers[0].lora_a.dtype

    def order_step(
        self, req_ids: list[str], adapters: Sequence[LoRAWeights | None]
    ) -> tuple[list[str], np.ndarray]:
        """Gives the step's adapters their slots (copying in the missing ones) and returns
        the request ids ordered by slot, stably, base model last, with their slots (-1:
        base). `adapters[i]` is request `req_ids[i]`'s adapter (None: the base model)."""
        present = {w.key: w for w in adapters if w is not None}
        if not present:
            return req_ids, np.full(len(req_ids), -1, np.int64)
        where, loads = self.slots.assign(present)
        for slot, key in loads:
            modules = present[key].modules
            for wrapper in self.wrappers:
                wrapper.load_slot(slot, modules)
        slots = np.fromiter(
            (-1 if w is None else where[w.key] for w in adapters), np.int64, len(adapters)
        )
        order = np.argsort(np.where(slots < 0, len(self.slots.keys), slots), kind="stable")
        return [req_ids[i] for i in order.tolist()], slots[order]

    def begin_step(self, request_slots: np.ndarray, query_lens: np.ndarray) -> None:
        """The step's batch from its requests' slots (as `order_step` ordered them) and
        their rows; every wrapper reads it during the forward."""
        self.step.batch = build_lora_batch(request_slots, query_lens)

    def end_step(self) -> None:
        self.step.batch = None
