"""`SlotTable`: which adapter sits in which of the `lora.max_loras` device slots (LRU).

Pure bookkeeping (no tensors): each step asks for the slots of the adapters it runs; an
adapter already resident keeps its slot, a missing one takes a free slot or evicts the
least recently used adapter that this step does not need. The scheduler never runs more
distinct adapters in one step than there are slots, so a step always fits.
"""

from __future__ import annotations

from collections.abc import Iterable


class SlotTable:
    def __init__(self, num_slots: int):
        self.keys: list[bytes | None] = [None] * num_slots
        self._last_used = [0] * num_slots
        self._clock = 0
        self.num_loads = 0  # adapters written into a slot (first use or after eviction)

    def slot_of(self, key: bytes) -> int | None:
        try:
            return self.keys.index(key)
        except ValueError:
            return None

    def assign(self, keys: Iterable[bytes]) -> tuple[dict[bytes, int], list[tuple[int, bytes]]]:
        """Slots for this step's adapters: ({key: slot}, [(slot, key) to load now])."""
        self._clock += 1
        wanted = list(dict.fromkeys(keys))
        if len(wanted) > len(self.keys):
            raise RuntimeError(
                f"a step runs {len(wanted)} adapters but there are {len(self.keys)} slots "
                "(lora.max_loras); the scheduler should have held some back"
            )
        where: dict[bytes, int] = {}
        for key in wanted:
            slot = self.slot_of(key)
            if slot is not None:
                where[key] = slot
                self._last_used[slot] = self._clock
        loads = []
        for key in wanted:
            if key in where:
                continue
            slot = min(
                (s for s in range(len(self.keys)) if self._last_used[s] != self._clock),
                key=lambda s: (self.keys[s] is not None, self._last_used[s]),
            )
            self.keys[slot] = key
            self._last_used[slot] = self._clock
            where[key] = slot
            loads.append((slot, key))
        self.num_loads += len(loads)
        return where, loads
