"""`ModelLoRA`: the runner's LoRA side, and the start-up rule for what LoRA runs with.

At construction the model's targetable linears are wrapped (`layers.wrap_linears`). Each
step, `begin_step` takes the adapter of every request in step order, gives each distinct
adapter a device slot (`SlotTable`: resident ones stay, missing ones are copied in over the
least recently used), and sets the step's `LoRABatch`, which every wrapper reads during the
forward. `end_step` clears it.
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
    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device):
        self.device = device
        self.step = LoRAStep()
        self.shapes: LoRAShapes = lora_shapes(model)
        self.wrappers = wrap_linears(model, config.max_loras, config.max_lora_rank, self.step)
        self.slots = SlotTable(config.max_loras)

    def begin_step(self, adapters: Sequence[LoRAWeights | None], query_lens: np.ndarray) -> None:
        """`adapters[i]`: request i's adapter (None: the base model), in step order;
        `query_lens[i]`: its rows in this step."""
        present = {w.key: w for w in adapters if w is not None}
        if not present:
            self.step.batch = None
            return
        where, loads = self.slots.assign(present)
        for slot, key in loads:
            modules = present[key].modules
            for wrapper in self.wrappers:
                wrapper.load_slot(slot, modules)
        request_slots = np.fromiter(
            (-1 if w is None else where[w.key] for w in adapters), np.int64, len(adapters)
        )
        self.step.batch = build_lora_batch(request_slots, query_lens, self.device)

    def end_step(self) -> None:
        self.step.batch = None
