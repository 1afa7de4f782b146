"""BlockPool and its free queue: exact block ids, LRU order, ref counts, cache map."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.core.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def h(n: int) -> bytes:
    return n.to_bytes(32, "little")


def test_free_queue_pops_head_appends_tail_and_removes_from_middle():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert ids(q) == [1, 3, 4, 2, 0]
    with pytest.raises(ValueError):
        q.append(blocks[0])
    for _ in range(5):
        q.popleft()
    assert len(q) == 0 and ids(q) == []
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[1])


def test_get_new_blocks_takes_ids_in_order_with_ref_one():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1


def test_free_blocks_appends_in_given_order_and_only_at_zero_refs():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([c, b, a])
    assert b.ref_cnt == 1
    assert ids(pool.free_queue) == [3, 2, 0]
    assert ids(pool.get_new_blocks(3)) == [3, 2, 0]
    with pytest.raises(ValueError):
        pool.free_blocks([KVBlock(9)])


def test_touch_takes_a_free_cached_block_out_of_the_middle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    assert pool.cache_full_block(blocks[1], h(1))
    pool.free_blocks(blocks)
    assert pool.get_cached_block(h(1)) is blocks[1]
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1
    assert ids(pool.free_queue) == [0, 2, 3]
    assert pool.num_free_blocks == 3


def test_reusing_a_cached_free_block_evicts_its_hash():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, h(7))
    pool.free_blocks([a, b])
    assert pool.num_cached_blocks == 1 and pool.num_evictions == 0
    (x,) = pool.get_new_blocks(1)
    assert x is a and a.block_hash is None
    assert pool.get_cached_block(h(7)) is None
    assert pool.num_cached_blocks == 0 and pool.num_evictions == 1
    pool.get_new_blocks(1)  # b had no hash: not an eviction
    assert pool.num_evictions == 1


def test_cache_full_block_keeps_the_first_block_for_a_hash():
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    assert pool.cache_full_block(a, h(1))
    assert not pool.cache_full_block(b, h(1))
    assert b.block_hash is None and pool.get_cached_block(h(1)) is a
    assert not pool.cache_full_block(a, h(2))  # already registered under h(1)
    assert pool.uncache_block(a) and not pool.uncache_block(a)
    assert pool.get_cached_block(h(1)) is None and pool.num_evictions == 0


def test_reset_prefix_cache_drops_hashes_of_free_and_used_blocks():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, h(1))
    pool.cache_full_block(b, h(2))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert a.block_hash is None and b.block_hash is None
    assert b.ref_cnt == 1 and ids(pool.free_queue) == [a.block_id]


def test_pool_rejects_zero_blocks():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_kv_cache_package_does_not_import_torch():
    code = "import sys, engine.core.kv_cache; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
