"""TierIndex: LRU by bytes, reservations that evict before writing, busy entries kept."""

from __future__ import annotations

import pytest

from engine.core.kv_tier.index import TierIndex


def h(n: int) -> bytes:
    return n.to_bytes(32, "little")


def test_reserve_evicts_least_recently_used_present_entries_by_bytes():
    idx = TierIndex("disk", capacity_bytes=300)
    for i in range(3):
        assert idx.reserve(h(i), 100) == []
        idx.confirm(h(i))
    assert idx.used_bytes == 300
    idx.touch(h(0))  # order now 1, 2, 0
    assert idx.reserve(h(3), 150) == [h(1), h(2)]
    assert idx.hashes() == [h(0), h(3)] and idx.used_bytes == 250
    assert not idx.has(h(3))  # reserved, not yet stored
    assert h(3) in idx


def test_reserved_and_busy_entries_are_never_evicted():
    idx = TierIndex("disk", capacity_bytes=200)
    idx.reserve(h(0), 100)  # a write in flight
    idx.reserve(h(1), 100)
    idx.confirm(h(1))
    idx.pin(h(1))  # a load in flight
    assert idx.reserve(h(2), 100) is None
    assert idx.hashes() == [h(0), h(1)] and idx.used_bytes == 200
    idx.unpin(h(1))
    assert idx.reserve(h(2), 100) == [h(1)]


def test_an_entry_larger_than_the_capacity_is_refused():
    idx = TierIndex("disk", capacity_bytes=99)
    assert idx.reserve(h(0), 100) is None and len(idx) == 0


def test_host_slots_are_reused_after_eviction():
    idx = TierIndex("host", capacity_bytes=2 * 10, num_slots=2)
    idx.reserve(h(0), 10)
    idx.reserve(h(1), 10)
    assert (idx.slot_of(h(0)), idx.slot_of(h(1))) == (0, 1)
    idx.confirm(h(0))
    idx.confirm(h(1))
    assert idx.reserve(h(2), 10) == [h(0)]
    assert idx.slot_of(h(2)) == 0 and idx.slot_of(h(0)) == -1
    idx.clear()
    idx.reserve(h(3), 10)
    assert idx.slot_of(h(3)) == 0


def test_listed_entries_go_to_the_lru_end_and_over_capacity_is_evicted():
    idx = TierIndex("disk", capacity_bytes=300)
    idx.reserve(h(9), 100)
    idx.confirm(h(9))
    assert idx.add_present(h(1), 100, lru_first=True)
    assert idx.hashes() == [h(1), h(9)]
    assert not idx.add_present(h(1), 100)  # known
    assert idx.add_present(h(2), 100) and not idx.add_present(h(3), 100)
    assert idx.add_present(h(3), 100, over_capacity=True) and idx.used_bytes == 400
    assert idx.evict_over_capacity() == [h(1)] and idx.used_bytes == 300


def test_reserving_a_known_hash_twice_is_a_bug():
    idx = TierIndex("disk", capacity_bytes=300)
    idx.reserve(h(0), 100)
    with pytest.raises(ValueError):
        idx.reserve(h(0), 100)
