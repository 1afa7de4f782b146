"""`LoRARegistry`: the adapters loaded into host memory, by name (the CPU cache).

Thread-safe: `acquire` runs wherever requests are prepared (a frontend's thread, a worker
thread that reads the files), the removal calls on the engine thread. Files are read
outside the lock, so a slow disk never blocks the engine loop.

Each request holds its adapter's `LoRAWeights` itself (they travel with it to the runner),
so dropping an adapter from the registry, by LRU beyond `lora.max_cpu_loras` or by a
removal, never changes a request already holding it; an evicted adapter is read again from
its path by the next request naming it. A removal has two halves: `begin_remove` (new
requests are refused from then on, and requests prepared before it but not yet queued are
refused by `check_admit`) and `finish_remove` once no request uses it. A name stays known
after its weights were evicted (until it is removed), so removing an evicted adapter is a
removal like any other (the drain, the epoch), never "not found".
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from engine.config import LoRAConfig
from engine.errors import LoRAError, LoRANotFoundError
from engine.lora_request import LoRARequest
from engine.worker.lora.peft_adapter import LoRAShapes, LoRAWeights, load_peft_adapter


class LoRARegistry:
    def __init__(self, shapes: LoRAShapes, config: LoRAConfig, dtype: torch.dtype):
        self.shapes = shapes
        self.max_rank = config.max_lora_rank
        self.dtype = dtype
        self.capacity = config.max_cpu_loras or max(config.max_loras, 32)
        self._lock = threading.Lock()
        self._loaded: OrderedDict[str, LoRAWeights] = OrderedDict()  # LRU order
        self._draining: dict[str, LoRAWeights | None] = {}  # None: evicted before removal
        self._known: dict[str, LoRARequest] = {}  # every name added and not removed
        # Removals per name: a request prepared under an older count is refused.
        self._epochs: dict[str, int] = {}

    def acquire(self, lora: LoRARequest) -> tuple[LoRAWeights, int]:
        """The adapter's weights (read and checked on first use) and its name's epoch for
        `check_admit`. Raises LoRAError naming the problem."""
        with self._lock:
            hit = self._lookup(lora)
            if hit is not None:
                return hit, self._epochs.get(lora.lora_name, 0)
        weights = load_peft_adapter(lora, self.shapes, self.max_rank, self.dtype)
        with self._lock:
            hit = self._lookup(lora)  # loaded by another thread meanwhile
            if hit is not None:
                return hit, self._epochs.get(lora.lora_name, 0)
            self._loaded[lora.lora_name] = weights
            self._known[lora.lora_name] = lora
            while len(self._loaded) > self.capacity:
                self._loaded.popitem(last=False)
            return weights, self._epochs.get(lora.lora_name, 0)

    def is_loaded(self, lora: LoRARequest) -> bool:
        with self._lock:
            held = self._loaded.get(lora.lora_name)
            return held is not None and held.lora == lora

    def check_admit(self, name: str, epoch: int) -> None:
        """Raises LoRAError when `name` was removed (or is being removed) since `epoch`."""
        with self._lock:
            if name in self._draining:
                raise LoRAError(f"LoRA adapter {name!r} is being removed")
            if self._epochs.get(name, 0) != epoch:
                raise LoRAError(f"LoRA adapter {name!r} was removed")

    def list(self) -> list[LoRARequest]:
        with self._lock:
            return [w.lora for w in self._loaded.values()]

    def begin_remove(self, name: str) -> None:
        """Stops handing out `name`; raises LoRANotFoundError when it is not loaded."""
        with self._lock:
            if name in self._draining:
                return
            weights = self._loaded.pop(name, None)
            if weights is None and name not in self._known:
                raise LoRANotFoundError(f"no LoRA adapter named {name!r:.80} is loaded")
            self._draining[name] = weights
            self._epochs[name] = self._epochs.get(name, 0) + 1

    def draining(self) -> list[str]:
        with self._lock:
            return list(self._draining)

    def finish_remove(self, name: str) -> None:
        with self._lock:
            self._draining.pop(name, None)
            self._known.pop(name, None)

    def _lookup(self, lora: LoRARequest) -> LoRAWeights | None:
        """The loaded weights for `lora`, None if not loaded; LoRAError on a conflict."""
        name = lora.lora_name
        if name in self._draining:
            raise LoRAError(f"LoRA adapter {name!r} is being removed")
        held = self._loaded.get(name)
        if held is None:
            for other in self._loaded.values():
                if other.lora.lora_int_id == lora.lora_int_id:
                    raise LoRAError(
                        f"lora_int_id {lora.lora_int_id} is already used by LoRA adapter "
                        f"{other.lora.lora_name!r}"
                    )
            return None
        if held.lora != lora:
            raise LoRAError(
                f"LoRA adapter {name!r} is loaded from {held.lora.lora_path} with lora_int_id "
                f"{held.lora.lora_int_id}; remove it before loading another under that name"
            )
        self._loaded.move_to_end(name)
        return held
