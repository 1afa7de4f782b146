"""Physical KV blocks: reference counts, an LRU free queue and the prefix-cache map.

Every block is in exactly one of two states:

- in use: ``ref_cnt > 0``, held by one or more requests' block tables (more than one after
  a prefix hit or a fork); not in the free queue;
- free: ``ref_cnt == 0``, in the free queue. A free block may still carry its
  ``block_hash`` and so still be found by a prefix lookup; it is "evicted" (its hash
  dropped) only when an allocation takes it.

The free queue is ordered by eviction priority::

    head (evicted first) <-> ... <-> tail (freed last, evicted last)

Allocation pops from the head; freeing appends to the tail, so cached blocks leave in LRU
order. A prefix hit pulls a free cached block out of the middle, hence the doubly linked
list: O(1) removal, where ``deque.remove`` would be O(n).

No block is reserved: block ids are ``0 .. num_blocks - 1`` and all of them can be handed out.

With a KV tier (engine/core/kv_tier) a third state exists, *held for saving*: a cached block
whose last reference went, which the tier's `save_hook` wants copied out. It stays out of the
free queue (so no allocation can overwrite it while the worker copies it) until
`release_saved`, and meanwhile still serves prefix hits like any cached block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from engine.core.kv_cache.hashing import BlockHash


class KVBlock:
    """One physical block of ``block_size`` KV slots (the same index in every layer)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "save_pending")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is registered in the pool's cache map (full, content known).
        self.block_hash: BlockHash | None = None
        # Free-queue links; both None iff the block is not in the queue.
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        # Held for saving to a KV tier: out of the free queue until `release_saved`.
        self.save_pending = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel ends: O(1) popleft, append, remove."""

    def __init__(self, blocks: list[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev
        self.num_free = len(blocks)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("popleft from an empty free queue")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Head (next to evict) to tail; for tests and debugging."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All physical blocks, their free queue and the map of cached full blocks by hash.

    The pool knows nothing of requests; `KVCacheManager` decides what to touch, free and
    register. Callers check `num_free_blocks` before `get_new_blocks`.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("num_blocks: must be >= 1")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        # Cached blocks whose hash was dropped because an allocation reused them.
        self.num_evictions = 0
        # KV tier: called for a cached block whose last reference goes; True holds it out
        # of the free queue for saving (see the module docstring). None: no tier.
        self.save_hook: Callable[[KVBlock], bool] | None = None
        self.num_held_for_save = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0, or held for saving); cached free blocks
        count as free."""
        return (self.num_blocks - self.free_queue.num_free) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, each with ref_cnt 1, evicting
        any cached ones. Raises ValueError if fewer than ``n`` are free."""
        if n > self.free_queue.num_free:
            raise ValueError(f"need {n} blocks, {self.free_queue.num_free} free")
        out = []
        popleft = self.free_queue.popleft
        for _ in range(n):
            block = popleft()
            if block.block_hash is not None:
                self._drop_hash(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block registered under ``block_hash``, in use or free; takes no reference."""
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block, taking free (cached) ones out of the free queue."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0 and not block.save_pending:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; those reaching 0 go to the free queue's tail
        in the given order (so the first one given is evicted first)."""
        append = self.free_queue.append
        hook = self.save_hook
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed with no references")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.save_pending:  # touched and freed again while being saved
                    continue
                if hook is not None and block.block_hash is not None and hook(block):
                    block.save_pending = True
                    self.num_held_for_save += 1
                else:
                    append(block)

    def release_saved(self, block: KVBlock) -> None:
        """The tier copied the block out: it joins the free queue's tail (most recently
        freed) unless a prefix hit took it meanwhile. No-op for a block not held."""
        if not block.save_pending:
            return
        block.save_pending = False
        self.num_held_for_save -= 1
        if block.ref_cnt == 0:
            self.free_queue.append(block)

    def free_scratch_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block of contents nobody will read (no hash: the
        slots of rejected speculative tokens); those reaching 0 go to the free queue's
        head, reused before any cached block is evicted."""
        appendleft = self.free_queue.appendleft
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed with no references")
            if block.block_hash is not None:
                raise ValueError(f"{block} holds a cached prefix; free it with free_blocks")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                appendleft(block)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full block under ``block_hash``. Returns False and changes nothing if
        that hash is already cached (by any block) or this block already has a hash."""
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def uncache_block(self, block: KVBlock) -> bool:
        """Drop the block's registration (no eviction counted); False if it had none."""
        if block.block_hash is None:
            return False
        self._drop_hash(block)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, of free and in-use blocks alike. Always succeeds:
        in-use blocks keep their contents and owners, they just can't be hit any more."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _drop_hash(self, block: KVBlock) -> None:
        h = block.block_hash
        if self.cached_blocks.get(h) is block:  # type: ignore[arg-type]
            del self.cached_blocks[h]  # type: ignore[arg-type]
        block.block_hash = None
