"""KVCacheManager: exact block ids for allocation, prefix hits, eviction, fork and CoW."""

from __future__ import annotations

import pytest

from engine.core.kv_cache import (
    BlockCopy,
    KVCacheManager,
    KVCacheStats,
    encode_extra_keys,
    hash_block_chain,
    hash_block_tokens,
)
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, tokens, cache_salt: str | None = None) -> Request:
    return Request(request_id, list(tokens), SamplingParams(), cache_salt=cache_salt)


def schedule(m: KVCacheManager, req: Request, num_new_tokens: int | None = None):
    """First scheduling as the scheduler does it: prefix lookup, then allocation."""
    hit_ids, hit_tokens = m.get_computed_blocks(req)
    n = req.num_tokens - hit_tokens if num_new_tokens is None else num_new_tokens
    new = m.allocate_slots(req, n, hit_ids)
    if new is not None:
        req.num_computed_tokens = hit_tokens + n
        m.count_prefix_query(req, hit_tokens)
    return hit_ids, new


def decode(m: KVCacheManager, req: Request, token: int) -> list[int] | None:
    """One decode step: the sampled token is appended, then its slot allocated."""
    req.append_output_token_ids([token])
    new = m.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


def refs(m: KVCacheManager, block_ids) -> list[int]:
    return [m.pool.blocks[i].ref_cnt for i in block_ids]


def free_queue(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.pool.free_queue]


def test_blocks_are_allocated_in_exact_order_and_decode_appends_only_at_boundaries():
    m = KVCacheManager(10, BS)
    a = make_request("a", range(10))
    assert schedule(m, a) == ([], [0, 1, 2])
    assert m.get_block_ids("a") == [0, 1, 2]
    assert m.num_free_blocks == 7
    assert m.stats().num_cached_blocks == 2  # the partial third block is not cached
    assert decode(m, a, 100) == []
    assert decode(m, a, 101) == []
    assert m.stats().num_cached_blocks == 3  # 12 tokens: block 2 became full
    assert decode(m, a, 102) == [3]
    b = make_request("b", range(50, 55))
    assert schedule(m, b) == ([], [4, 5])
    assert m.get_block_ids("a") == [0, 1, 2, 3] and m.get_block_ids("b") == [4, 5]
    assert m.get_block_ids("nope") == []


def test_second_request_hits_the_shared_two_block_prefix():
    m = KVCacheManager(10, BS)
    a = make_request("a", range(10))
    schedule(m, a)
    b = make_request("b", [*range(8), 50, 51, 52])
    assert m.get_computed_blocks(b) == ([0, 1], 8)
    assert m.get_computed_blocks(b) == ([0, 1], 8)  # a lookup alone counts nothing
    assert m.allocate_slots(b, 3, [0, 1]) == [3]
    m.count_prefix_query(b, 8)
    b.num_computed_tokens = 11
    assert m.get_block_ids("b") == [0, 1, 3]
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert m.stats() == KVCacheStats(
        num_blocks=10,
        num_free_blocks=6,
        num_cached_blocks=2,
        prefix_queries=10 + 11,
        prefix_hits=8,
        evictions=0,
        usage=0.4,
    )


def test_fully_cached_prompt_still_leaves_one_token_to_compute():
    m = KVCacheManager(10, BS)
    a = make_request("a", range(8))
    assert schedule(m, a) == ([], [0, 1])
    m.free(a)
    assert free_queue(m) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    b = make_request("b", range(8))
    assert m.get_computed_blocks(b) == ([0], 4)
    assert m.allocate_slots(b, 4, [0]) == [2]
    # Block 2 holds the same tokens as cached block 1: it stays unregistered.
    assert m.pool.blocks[2].block_hash is None
    assert m.pool.blocks[1].block_hash is not None
    assert m.stats().num_cached_blocks == 2


def test_least_recently_freed_cached_block_is_evicted_first():
    m = KVCacheManager(4, BS)
    a = make_request("a", [1, 1, 1, 1, 0])
    assert schedule(m, a) == ([], [0, 1])
    m.free(a)
    b = make_request("b", [2, 2, 2, 2, 0])
    assert schedule(m, b) == ([], [2, 3])
    m.free(b)
    assert free_queue(m) == [1, 0, 3, 2]
    c = make_request("c", [3, 3, 3, 3, 0])
    assert schedule(m, c) == ([], [1, 0])  # block 0 (a's prefix) is evicted
    assert m.stats().evictions == 1
    assert m.get_computed_blocks(make_request("a2", [1, 1, 1, 1, 9])) == ([], 0)
    assert m.get_computed_blocks(make_request("b2", [2, 2, 2, 2, 9])) == ([2], 4)


def test_free_releases_tail_first_so_the_prompt_prefix_survives_longest():
    m = KVCacheManager(6, BS)
    a = make_request("a", range(13))
    assert schedule(m, a) == ([], [0, 1, 2, 3])
    m.free(a)
    assert free_queue(m) == [4, 5, 3, 2, 1, 0]
    e = make_request("e", range(100, 116))
    assert schedule(m, e, 16) == ([], [4, 5, 3, 2])
    assert m.stats().evictions == 1  # block 2; block 3 was partial, never cached
    assert m.get_computed_blocks(make_request("a2", range(13))) == ([0, 1], 8)
    m.free(a)  # idempotent
    m.free(make_request("unknown", [1]))


def test_fork_then_child_write_into_shared_partial_block_copies_on_write():
    m = KVCacheManager(10, BS)
    p = make_request("p", range(6))
    assert schedule(m, p) == ([], [0, 1])
    c = make_request("c", range(6))
    assert m.fork(p, c, 6) == [0, 1]
    c.num_computed_tokens = 6
    assert refs(m, [0, 1]) == [2, 2]
    assert decode(m, c, 77) == []
    assert m.take_block_copies() == [BlockCopy(request_id="c", index=1, src=1, dst=2)]
    assert m.take_block_copies() == []
    assert m.get_block_ids("c") == [0, 2]
    assert refs(m, [0, 1, 2]) == [2, 1, 1]
    # The parent is now the sole owner of block 1: it writes in place.
    assert decode(m, p, 88) == []
    assert m.take_block_copies() == []
    assert m.get_block_ids("p") == [0, 1]
    m.free(c)
    m.free(p)
    assert m.num_free_blocks == 10


def test_child_alone_in_a_block_its_freed_parent_filled_takes_it_out_of_the_cache():
    # The child shares the first 2 tokens of a block the parent then filled and
    # registered; the parent leaves. Writing the child's 3rd token in place would change
    # the block's contents under its hash, and a later prompt equal to the parent's would
    # read the child's token as its own (found by the KV property test).
    m = KVCacheManager(2, BS)
    p = make_request("p", [0, 0, 0, 0])
    assert schedule(m, p) == ([], [0])
    c = make_request("c", [0, 0])
    assert m.fork(p, c, 2) == [0]
    c.num_computed_tokens = 2
    m.free(p)
    assert refs(m, [0]) == [1]
    assert decode(m, c, 1) == []  # in place: nobody else holds block 0
    assert m.take_block_copies() == []
    q = make_request("q", [0, 0, 0, 0, 5])
    hit_ids, _ = m.get_computed_blocks(q)
    assert hit_ids == []  # block 0 now holds [0, 0, 1, ...]: no longer a hit
    m.free(c)
    assert m.num_free_blocks == 2


def test_fork_at_a_block_boundary_needs_no_copy():
    m = KVCacheManager(10, BS)
    p = make_request("p", range(8))
    schedule(m, p)
    c = make_request("c", range(8))
    assert m.fork(p, c, 8) == [0, 1]
    c.num_computed_tokens = 8
    assert decode(m, c, 5) == [2]
    assert decode(m, p, 6) == [3]
    assert m.take_block_copies() == []
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]


def test_fork_rejects_a_child_with_different_tokens():
    m = KVCacheManager(10, BS)
    p = make_request("p", range(8))
    schedule(m, p)
    with pytest.raises(ValueError):
        m.fork(p, make_request("c", [9, *range(1, 8)]), 8)
    with pytest.raises(ValueError):
        m.fork(p, make_request("c", range(9)), 9)  # beyond the parent's tokens
    assert refs(m, [0, 1]) == [1, 1]


def test_allocate_returns_none_and_changes_nothing_when_short():
    m = KVCacheManager(4, BS)
    schedule(m, make_request("a", range(12)))
    b = make_request("b", range(20, 28))
    assert m.allocate_slots(b, 8) is None
    assert m.num_free_blocks == 1 and m.get_block_ids("b") == []
    assert m.allocate_slots(b, 4) == [3]


def test_touching_cached_free_blocks_counts_against_free_blocks():
    m = KVCacheManager(3, BS)
    a = make_request("a", range(8))
    schedule(m, a)
    m.free(a)
    schedule(m, make_request("c", range(50, 54)))  # takes block 2
    assert free_queue(m) == [1, 0]
    b = make_request("b", [*range(8), 5])
    assert m.get_computed_blocks(b) == ([0, 1], 8)
    # Needs 2 touched free blocks + 1 new block, only 2 free.
    assert m.allocate_slots(b, 1, [0, 1]) is None
    assert free_queue(m) == [1, 0] and refs(m, [0, 1]) == [0, 0]
    assert m.get_block_ids("b") == [] and m.stats().num_cached_blocks == 3


def test_allocate_returns_none_when_the_copy_on_write_block_is_short():
    m = KVCacheManager(2, BS)
    p = make_request("p", range(6))
    schedule(m, p)
    c = make_request("c", range(6))
    m.fork(p, c, 6)
    c.num_computed_tokens = 6
    assert decode(m, c, 1) is None
    assert m.take_block_copies() == [] and refs(m, [0, 1]) == [2, 2]


def test_stale_computed_blocks_are_refused():
    m = KVCacheManager(2, BS)
    a = make_request("a", [7, 7, 7, 7, 0])
    schedule(m, a)
    m.free(a)
    b = make_request("b", [7, 7, 7, 7, 1])
    assert m.get_computed_blocks(b) == ([0], 4)
    c = make_request("c", range(8))
    schedule(m, c)  # evicts block 0 and caches other tokens in it
    m.free(c)
    with pytest.raises(ValueError):
        m.allocate_slots(b, 1, [0])


def test_prefix_caching_disabled_never_hits_or_caches():
    m = KVCacheManager(10, BS, enable_prefix_caching=False)
    a = make_request("a", range(10))
    assert schedule(m, a) == ([], [0, 1, 2])
    m.free(a)
    b = make_request("b", range(10))
    assert m.get_computed_blocks(b) == ([], 0)
    assert schedule(m, b) == ([], [3, 4, 5])
    s = m.stats()
    assert (s.num_cached_blocks, s.prefix_queries, s.prefix_hits, s.evictions) == (0, 0, 0, 0)


def test_preempted_request_resumes_with_its_prompt_and_output_cached():
    m = KVCacheManager(10, BS)
    a = make_request("a", range(6))
    schedule(m, a)
    decode(m, a, 60)
    decode(m, a, 61)  # 8 tokens computed: block 1 is now full and cached
    a.append_output_token_ids([62])
    m.free(a)  # preemption: free first, then reset
    a.num_computed_tokens = 0
    assert m.get_computed_blocks(a) == ([0, 1], 8)
    assert m.allocate_slots(a, 1, [0, 1]) == [2]


def test_blocks_freed_before_their_step_ran_are_not_hit():
    m = KVCacheManager(10, BS)
    a = make_request("a", range(9))
    assert m.allocate_slots(a, 9) == [0, 1, 2]
    assert m.stats().num_cached_blocks == 2
    m.free(a)  # same-step preemption: num_computed_tokens never advanced
    assert m.stats().num_cached_blocks == 0
    assert m.get_computed_blocks(make_request("b", range(9))) == ([], 0)


def test_hit_blocks_stay_cached_when_the_hitting_request_is_freed_early():
    m = KVCacheManager(10, BS)
    schedule(m, make_request("a", range(9)))
    b = make_request("b", range(12))
    assert m.get_computed_blocks(b) == ([0, 1], 8)
    assert m.allocate_slots(b, 4, [0, 1]) == [3]
    m.free(b)  # before its step ran: block 3 loses its hash, the hit blocks keep theirs
    assert m.pool.blocks[3].block_hash is None
    assert m.get_computed_blocks(make_request("c", range(12))) == ([0, 1], 8)


def test_cache_salt_separates_otherwise_equal_prompts():
    m = KVCacheManager(10, BS)
    schedule(m, make_request("a", range(9), cache_salt="tenant-1"))
    assert m.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert m.get_computed_blocks(make_request("c", range(9), cache_salt="tenant-2")) == ([], 0)
    assert m.get_computed_blocks(make_request("d", range(9), cache_salt="tenant-1")) == (
        [0, 1],
        8,
    )


def test_reused_request_id_does_not_inherit_hashes():
    m = KVCacheManager(10, BS)
    schedule(m, make_request("y", range(9)))
    assert m.get_computed_blocks(make_request("x", range(100, 109))) == ([], 0)
    assert m.get_computed_blocks(make_request("x", range(9))) == ([0, 1], 8)


def test_reset_prefix_cache_forgets_hits_but_keeps_tables():
    m = KVCacheManager(10, BS)
    a = make_request("a", range(9))
    schedule(m, a)
    assert m.reset_prefix_cache()
    assert m.stats().num_cached_blocks == 0
    assert m.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert m.get_block_ids("a") == [0, 1, 2]
    decode(m, a, 9)
    decode(m, a, 10)
    decode(m, a, 11)  # 12 tokens: only block 2 is newly cached
    assert m.stats().num_cached_blocks == 1


def test_usage_counts_referenced_blocks_only():
    m = KVCacheManager(4, BS)
    a = make_request("a", range(5))
    schedule(m, a)
    assert m.usage == 0.5 and m.num_free_blocks == 2
    m.free(a)
    assert m.usage == 0.0 and m.num_free_blocks == 4 and m.stats().num_cached_blocks == 1


def test_block_hash_chain_matches_per_block_hashes_and_depends_on_everything():
    tokens = list(range(12))
    extra = encode_extra_keys(("salt",))
    chain = hash_block_chain(None, tokens + [99], 4, extra)  # trailing partial block ignored
    h0 = hash_block_tokens(None, tokens[:4], extra)
    h1 = hash_block_tokens(h0, tokens[4:8], extra)
    assert chain == [h0, h1, hash_block_tokens(h1, tokens[8:12], extra)]
    assert all(len(h) == 32 for h in chain)
    assert hash_block_tokens(None, tokens[4:8], extra) != h1  # parent matters
    assert hash_block_tokens(h0, tokens[4:8]) != h1  # extra keys matter
    assert hash_block_chain(None, [1, 2, 3], 4) == []


def test_extra_key_encoding_is_unambiguous():
    encodings = [
        encode_extra_keys(k)
        for k in [(), ("",), ("a",), (b"a",), (1,), ("a", ""), ("a", 1), ("a1",), (97,)]
    ]
    assert len(set(encodings)) == len(encodings)
