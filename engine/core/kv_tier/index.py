"""What one KV tier holds, by block hash, in LRU order: the core's own index of the tier.

The worker stores and reads; this index decides. An entry is *reserved* when a save is
decided (its bytes count at once, so the evictions it causes go out before the write and the
tier never exceeds its capacity), *present* once the worker reports it stored (only present
entries are hit), and *busy* while a load reads it or, on the host tier, while a disk write
still reads its slot: a busy entry is never evicted, so no slot is overwritten and no file
deleted under a reader of ours. Eviction takes the least recently used idle entry.

Host tier entries also own a slot (0 .. num_slots - 1) of the worker's pinned buffer; disk
entries own nothing but their file's bytes.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.core.kv_cache.hashing import BlockHash


class _Entry:
    __slots__ = ("nbytes", "slot", "present", "busy")

    def __init__(self, nbytes: int, slot: int):
        self.nbytes = nbytes
        self.slot = slot
        self.present = False
        self.busy = 0


class TierIndex:
    """Entries by block hash, least recently used first, within `capacity_bytes`.

    `num_slots` > 0 gives each entry one slot (a host tier: every entry has the same size,
    the capacity is `num_slots` entries).
    """

    def __init__(self, name: str, capacity_bytes: int, num_slots: int = 0):
        if capacity_bytes < 1:
            raise ValueError(f"{name} tier: capacity must be >= 1 byte")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self.num_slots = num_slots
        # Free slots, popped from the end (slot 0 first); None: entries have no slots.
        self._free_slots = list(range(num_slots - 1, -1, -1)) if num_slots else None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, h: BlockHash) -> bool:
        """Known to the tier: reserved or present (no second save of it is needed)."""
        return h in self._entries

    def has(self, h: BlockHash) -> bool:
        """Present: a load of it can be issued."""
        e = self._entries.get(h)
        return e is not None and e.present

    @property
    def num_present(self) -> int:
        return sum(1 for e in self._entries.values() if e.present)

    def slot_of(self, h: BlockHash) -> int:
        e = self._entries.get(h)
        return -1 if e is None else e.slot

    def reserve(self, h: BlockHash, nbytes: int) -> list[BlockHash] | None:
        """Makes room for `h` (evicting idle LRU entries) and reserves it as the most recently
        used. Returns the evicted hashes, or None (nothing changed) when there is no room:
        larger than the capacity, no slot free, or everything in the way busy."""
        if h in self._entries:
            raise ValueError(f"{self.name} tier: {h.hex()[:12]} reserved twice")
        over = self.used_bytes + nbytes - self.capacity_bytes
        need_slot = self._free_slots is not None and not self._free_slots
        victims: list[BlockHash] = []
        if over > 0 or need_slot:
            freed = 0
            for vh, e in self._entries.items():
                if freed >= over and (victims or not need_slot):
                    break
                if e.busy or not e.present:
                    continue
                victims.append(vh)
                freed += e.nbytes
            if freed < over or (need_slot and not victims):
                return None
            for vh in victims:
                self.drop(vh)
        slot = self._free_slots.pop() if self._free_slots is not None else -1
        self._entries[h] = _Entry(nbytes, slot)
        self.used_bytes += nbytes
        return victims

    def add_present(
        self, h: BlockHash, nbytes: int, lru_first: bool = False, over_capacity: bool = False
    ) -> bool:
        """An entry found on the medium (start-up listing, another replica's file): present
        at once. `lru_first`: it goes to the LRU end (older than everything known). False
        when already known or it does not fit without evicting, unless `over_capacity`
        (then `evict_over_capacity` must follow)."""
        if h in self._entries:
            return False
        if self.used_bytes + nbytes > self.capacity_bytes and not over_capacity:
            return False
        if self._free_slots is not None:
            if not self._free_slots:
                return False
            slot = self._free_slots.pop()
        else:
            slot = -1
        e = self._entries[h] = _Entry(nbytes, slot)
        e.present = True
        if lru_first:
            self._entries.move_to_end(h, last=False)
        self.used_bytes += nbytes
        return True

    def confirm(self, h: BlockHash) -> bool:
        """The worker stored it: present from now on. False for an entry dropped meanwhile."""
        e = self._entries.get(h)
        if e is None:
            return False
        e.present = True
        return True

    def touch(self, h: BlockHash) -> None:
        """Most recently used (a hit)."""
        if h in self._entries:
            self._entries.move_to_end(h)

    def pin(self, h: BlockHash) -> None:
        self._entries[h].busy += 1

    def unpin(self, h: BlockHash) -> None:
        e = self._entries.get(h)
        if e is not None and e.busy > 0:
            e.busy -= 1

    def drop(self, h: BlockHash) -> bool:
        """Forgets the entry (evicted, failed, gone from the medium); its slot is free again."""
        e = self._entries.pop(h, None)
        if e is None:
            return False
        self.used_bytes -= e.nbytes
        if self._free_slots is not None and e.slot >= 0:
            self._free_slots.append(e.slot)
        return True

    def evict_over_capacity(self) -> list[BlockHash]:
        """Drops idle LRU entries until within capacity (after entries were added from a
        shared medium, or the capacity is exceeded otherwise); returns them."""
        out: list[BlockHash] = []
        if self.used_bytes <= self.capacity_bytes:
            return out
        for h, e in list(self._entries.items()):
            if self.used_bytes <= self.capacity_bytes:
                break
            if e.present and not e.busy:
                self.drop(h)
                out.append(h)
        return out

    def clear(self) -> list[BlockHash]:
        """Forgets everything (the tier was switched off); returns what it held."""
        out = list(self._entries)
        self._entries.clear()
        self.used_bytes = 0
        if self._free_slots is not None:
            self._free_slots = list(range(self.num_slots - 1, -1, -1))
        return out

    def hashes(self) -> list[BlockHash]:
        """Every entry, least recently used first (tests, flushing)."""
        return list(self._entries)
