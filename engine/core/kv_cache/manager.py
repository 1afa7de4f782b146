"""Per-request block tables over a `BlockPool`: prefix hits, allocation, fork and free.

Token ranges of one request at an `allocate_slots` call (bs = block_size)::

    all_token_ids: [ computed | new computed blocks | write range: num_new_tokens | ... ]
                   0   num_computed_tokens        start                            end
    block table:   [ b0 | b1 | ... | b(ceil(end / bs) - 1) ]

Slots for ``[start, end)`` must exist and be writable by this request alone: blocks are
appended as needed, and a block in the write range shared with another table (after
`fork`) is first replaced by a private copy (copy-on-write, reported as a `BlockCopy`).
Blocks full of known tokens by ``end`` are registered in the prefix cache under their
chained hash (see `hashing`), so another request can hit them, even in the same step: the
runner writes a step's K/V before any attention reads it.

A block's hash is trusted as a promise that its KV is (or will be by the end of this step)
written. If a request is freed before that (same-step preemption, a failed step), `free`
unregisters its blocks past ``request.num_computed_tokens``, so a later hit can never read
unwritten KV. Hence the scheduler's contract: advance ``num_computed_tokens`` only once
the step's K/V are written (or at least after any same-step `free`), and call `free`
before resetting ``num_computed_tokens`` on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.kv_cache.block_pool import BlockPool, KVBlock
from engine.core.kv_cache.hashing import BlockHash, encode_extra_keys, hash_block_chain
from engine.core.request import Request


@dataclass
class BlockCopy:
    """A copy-on-write the runner must perform (every layer) before the forward."""

    request_id: str
    index: int  # position in the request's block table that was replaced
    src: int  # block id copied from
    dst: int  # new block id (now at table[index])


@dataclass
class KVCacheStats:
    """A snapshot for metrics; the counters are cumulative since start."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_queries: int  # tokens looked up by the lookups that admitted a request
    prefix_hits: int  # tokens those lookups found cached
    evictions: int  # cached blocks whose hash was dropped on reuse
    usage: float  # fraction of blocks with ref_cnt > 0


class _ReqState:
    """What the manager keeps per request id until `free`."""

    __slots__ = ("request", "blocks", "hashes", "extra_keys", "num_cached", "num_trusted")

    def __init__(self, request: Request):
        self.request = request  # identity check: a reused id must not inherit state
        self.blocks: list[KVBlock] = []  # the block table
        # Chained hashes of the request's full blocks, computed once, valid for the life of
        # the request (tokens are only ever appended), also across preemption.
        self.hashes: list[BlockHash] = []
        self.extra_keys: bytes | None = None  # encoded lazily, from request.cache_keys
        # Table blocks [0, num_cached) are past registration: registered, or left
        # unregistered because another block already held their hash.
        self.num_cached = 0
        # Table head whose KV was written before this table got it (prefix hit or fork).
        self.num_trusted = 0


class KVCacheManager:
    """Owns the block pool and every request's block table; the scheduler's KV interface.

    State is kept per request id from the first `get_computed_blocks`, `allocate_slots` or
    `fork` until `free`, so call `free` for every request the manager has seen when it
    finishes, is aborted (waiting or running) or is preempted; it is idempotent.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError("block_size: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._reqs: dict[str, _ReqState] = {}
        self._copies: list[BlockCopy] = []
        self._prefix_queries = 0
        self._prefix_hits = 0

    # ---- lookups -------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached full-block prefix of ``request.all_token_ids`` (prompt and any
        output: a preempted request recomputes both), always leaving >= 1 token to compute
        so the step samples. Returns (block ids, their token count). Takes no references:
        pass the ids to `allocate_slots` right away, before anything else allocates.
        Counts nothing: a lookup whose allocation fails is repeated next step, so the
        scheduler counts the one that admits the request (`count_prefix_query`).
        ``([], 0)`` when prefix caching is off or the request `skips_prefix_cache_reads`
        (it still registers its own full blocks for others).
        """
        if not self.enable_prefix_caching or request.skips_prefix_cache_reads:
            return [], 0
        st = self._state(request)
        num_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes_upto(st, num_blocks)
        cached = self.pool.cached_blocks
        ids: list[int] = []
        for i in range(num_blocks):
            block = cached.get(hashes[i])
            if block is None:
                break
            ids.append(block.block_id)
        return ids, len(ids) * self.block_size

    def count_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Counts the lookup that admitted `request`: a query of its `num_tokens` tokens, a
        hit of `num_hit_tokens` (the prefix cache hit rate is hits / queries). A request
        that `skips_prefix_cache_reads` made no lookup and counts nothing."""
        if self.enable_prefix_caching and not request.skips_prefix_cache_reads:
            self._prefix_queries += request.num_tokens
            self._prefix_hits += num_hit_tokens

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first `num_blocks` full blocks (the same keys
        the prefix cache uses, extra keys included: the KV tiers key blocks by them too).
        Computed once per request and kept until `free`."""
        return self._hashes_upto(self._state(request), num_blocks)[:num_blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] for an unknown id)."""
        st = self._reqs.get(request_id)
        return [b.block_id for b in st.blocks] if st is not None else []

    # ---- allocation ----------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
    ) -> list[int] | None:
        """Make the table cover ``request.num_computed_tokens + len(new_computed_blocks) *
        block_size + num_new_tokens`` tokens (see the module diagram).

        ``new_computed_blocks`` (from `get_computed_blocks`, only at first scheduling) get a
        reference and become the table's head. Returns the ids of blocks appended to the
        table, or None, changing nothing, when the free blocks cannot cover the new blocks,
        the copy-on-write blocks and the cached free blocks being touched. Copies are read
        with `take_block_copies`. The caller advances ``num_computed_tokens`` afterwards.
        """
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self._state(request)
        blocks = st.blocks
        bs = self.block_size

        # Fast path (most decode steps): the write range lies in one private table block.
        if not new_computed_blocks:
            start = request.num_computed_tokens
            end = start + num_new_tokens
            first = start // bs
            if (
                end <= (first + 1) * bs
                and first < len(blocks)
                and blocks[first].ref_cnt == 1
                and blocks[first].block_hash is None
            ):
                if (
                    self.enable_prefix_caching
                    and end // bs > st.num_cached
                    and request.writes_prefix_cache
                ):
                    num_full = min(end, len(request.all_token_ids)) // bs
                    if num_full > st.num_cached:
                        self._register(st, num_full)
                return []

        pool = self.pool
        hit_blocks: list[KVBlock] = []
        num_evictable_hits = 0
        if new_computed_blocks:
            if blocks:
                raise ValueError(
                    f"{request.request_id}: new_computed_blocks given to a non-empty table"
                )
            hit_blocks = [pool.blocks[i] for i in new_computed_blocks]
            self._check_hits(st, hit_blocks)
            # A free hit leaves the free queue when touched; one held for a tier's save is
            # not in it (engine/core/kv_tier), so it costs no free block.
            num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0 and not b.save_pending)

        start = request.num_computed_tokens + len(hit_blocks) * bs
        end = start + num_new_tokens
        num_required = -(-end // bs)
        num_have = len(blocks) + len(hit_blocks)
        num_new = num_required - num_have if num_required > num_have else 0

        # Existing blocks in the write range that another table shares: copy-on-write. One
        # that only this table holds but that is registered (a forked child's share of a
        # block its parent filled, then freed) holds cached contents the write would
        # change under the hash: it leaves the cache instead.
        cow: list[int] | None = None
        uncache: list[KVBlock] | None = None
        for i in range(start // bs, min(len(blocks), num_required)):
            if blocks[i].ref_cnt > 1:
                if cow is None:
                    cow = []
                cow.append(i)
            elif blocks[i].block_hash is not None:
                if uncache is None:
                    uncache = []
                uncache.append(blocks[i])

        num_needed = num_new + num_evictable_hits + (len(cow) if cow else 0)
        if num_needed > pool.free_queue.num_free:
            return None

        if hit_blocks:
            pool.touch(hit_blocks)  # before get_new_blocks, which could evict them
            blocks.extend(hit_blocks)
            st.num_cached = st.num_trusted = len(hit_blocks)
        if cow:
            self._copy_on_write(request.request_id, blocks, cow)
        if uncache:
            for block in uncache:
                pool.uncache_block(block)
        new_ids: list[int] = []
        if num_new:
            new_blocks = pool.get_new_blocks(num_new)
            blocks.extend(new_blocks)
            new_ids = [b.block_id for b in new_blocks]

        if self.enable_prefix_caching and request.writes_prefix_cache:
            num_full = min(end, len(request.all_token_ids)) // bs
            if num_full > st.num_cached:
                self._register(st, num_full)
        return new_ids

    def fork(self, parent: Request, child: Request, num_tokens: int) -> list[int]:
        """Give ``child`` the parent's KV for its first ``num_tokens`` tokens (n > 1 samples,
        beam search): the child's table becomes the parent's first ceil(num_tokens / bs)
        blocks, each with one more reference. A shared partial last block is copied on the
        first write into it, by either side. The tokens must be equal up to ``num_tokens``;
        the caller sets ``child.num_computed_tokens = num_tokens``. Needs no free blocks.
        """
        pst = self._reqs.get(parent.request_id)
        if pst is None or pst.request is not parent:
            raise ValueError(f"fork: parent {parent.request_id!r} holds no blocks")
        bs = self.block_size
        n = -(-num_tokens // bs)
        if not 0 < num_tokens <= parent.num_tokens or n > len(pst.blocks):
            raise ValueError(f"fork: parent's table does not cover {num_tokens} tokens")
        if child.all_token_ids[:num_tokens] != parent.all_token_ids[:num_tokens]:
            raise ValueError("fork: child's tokens differ from the parent's")
        cst = self._state(child)
        if cst.blocks:
            raise ValueError(f"fork: child {child.request_id!r} already holds blocks")
        shared = pst.blocks[:n]
        self.pool.touch(shared)
        cst.blocks = shared
        num_full = num_tokens // bs
        cst.num_trusted = num_full
        cst.num_cached = min(pst.num_cached, num_full)
        if child.cache_keys == parent.cache_keys and not cst.hashes:
            cst.hashes = pst.hashes[: min(len(pst.hashes), num_full)]
        return [b.block_id for b in shared]

    def free(self, request: Request) -> None:
        """Release the request's blocks tail first, so the free queue evicts its last
        blocks first and its prompt prefix stays cached longest, and forget all its state
        (hashes included: a resumed request rehashes). Registered blocks past
        ``request.num_computed_tokens`` and past any prefix-hit or forked head are
        unregistered first (their KV may be unwritten). A no-op for an unknown id.
        """
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return
        blocks = st.blocks
        keep = max(st.request.num_computed_tokens // self.block_size, st.num_trusted)
        for i in range(keep, min(st.num_cached, len(blocks), len(st.hashes))):
            block = blocks[i]
            if block.block_hash is not None and block.block_hash == st.hashes[i]:
                self.pool.uncache_block(block)
        self.pool.free_blocks(reversed(blocks))

    def truncate(self, request: Request, num_tokens: int) -> int:
        """Speculative decoding: gives back the table's blocks past the first
        ceil(num_tokens / block_size) (slots of rejected proposals and of a draft model's
        lookahead). No copy: those blocks were written only by this request in the step just
        verified, never registered (they held no known token when allocated); they go to
        the head of the free queue, so they are reused before any cached block is evicted.
        Returns the table's new length."""
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            return 0
        blocks = st.blocks
        keep = max(-(-num_tokens // self.block_size), st.num_cached, st.num_trusted)
        if keep < len(blocks):
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.free_scratch_blocks(tail)
        return len(blocks)

    def num_blocks_held(self, request_id: str) -> int:
        """The length of the request's block table (0 for an unknown id)."""
        st = self._reqs.get(request_id)
        return len(st.blocks) if st is not None else 0

    def take_block_copies(self) -> list[BlockCopy]:
        """The copy-on-writes recorded since the last call, in order; clears them."""
        copies, self._copies = self._copies, []
        return copies

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (e.g. after a weight update). Always succeeds:
        blocks in use keep their owners and contents, they just can't be hit any more."""
        return self.pool.reset_prefix_cache()

    # ---- state and metrics ---------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.free_queue.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    def stats(self) -> KVCacheStats:
        pool = self.pool
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
            evictions=pool.num_evictions,
            usage=pool.usage,
        )

    # ---- internals -----------------------------------------------------------------

    def _state(self, request: Request) -> _ReqState:
        """The request's state, created if absent; a different Request object under the same
        id replaces stale hash-only state but may not take over a block table."""
        st = self._reqs.get(request.request_id)
        if st is not None and st.request is request:
            return st
        if st is not None and st.blocks:
            raise ValueError(f"request id {request.request_id!r} already holds blocks")
        st = self._reqs[request.request_id] = _ReqState(request)
        return st

    def _hashes_upto(self, st: _ReqState, n: int) -> list[BlockHash]:
        """The request's block hash list, extended to at least ``n`` entries."""
        hashes = st.hashes
        have = len(hashes)
        if have < n:
            if st.extra_keys is None:
                st.extra_keys = encode_extra_keys(st.request.cache_keys)
            bs = self.block_size
            tokens = st.request.all_token_ids[have * bs : n * bs]
            parent = hashes[-1] if hashes else None
            hashes.extend(hash_block_chain(parent, tokens, bs, st.extra_keys))
        return hashes

    def _register(self, st: _ReqState, num_full: int) -> None:
        """Register table blocks [num_cached, num_full) under their hashes."""
        hashes = self._hashes_upto(st, num_full)
        cache = self.pool.cache_full_block
        blocks = st.blocks
        for i in range(st.num_cached, num_full):
            cache(blocks[i], hashes[i])
        st.num_cached = num_full

    def _check_hits(self, st: _ReqState, hit_blocks: list[KVBlock]) -> None:
        """Refuse prefix-hit blocks that no longer hold this request's prefix (evicted or
        reused since `get_computed_blocks`): using them would read another prompt's KV."""
        hashes = self._hashes_upto(st, len(hit_blocks))
        for i, block in enumerate(hit_blocks):
            if block.block_hash is None or block.block_hash != hashes[i]:
                raise ValueError(
                    f"{st.request.request_id}: computed block {block.block_id} at index {i} "
                    "is no longer cached; call get_computed_blocks again"
                )

    def _copy_on_write(self, request_id: str, blocks: list[KVBlock], indices: list[int]) -> None:
        pool = self.pool
        for i in indices:
            old = blocks[i]
            (new,) = pool.get_new_blocks(1)
            blocks[i] = new
            pool.free_blocks((old,))  # shared, so it stays referenced elsewhere
            self._copies.append(BlockCopy(request_id, i, old.block_id, new.block_id))
