"""The KV tiers in the torch-free core: save on free (held until copied, named in the step's
messages), loads that put a request in the loading state without holding the step, every
way out of that state releasing its blocks, failed loads computed instead, the tiers' bounds
and keys. The worker is `tests/support/kv_tier_fake.py`, reporting when the test says."""

from __future__ import annotations

from engine.core.kv_cache.hashing import encode_extra_keys, hash_block_chain
from engine.core.request import Request, RequestStatus
from engine.core.step_io import DISK_TIER, HOST_TIER, KVMove, KVTierReport
from engine.sampling_params import SamplingParams
from tests.support.kv_tier_fake import (
    FILE_BYTES,
    FakeTierWorker,
    run_until_idle,
    tier_scheduler,
    tier_step,
)
from tests.support.scheduler_helpers import make_request

PREFIX = list(range(100, 108))  # two full blocks of 4


def req(rid: str, tokens: list[int], max_tokens: int = 1, salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), cache_salt=salt)


def hashes(tokens: list[int], salt: str | None = None) -> list[bytes]:
    keys = encode_extra_keys((salt,) if salt else ())
    return hash_block_chain(None, tokens, 4, keys)


def evict_pool(sched, worker, rid: str = "filler") -> None:
    """Runs a request that takes every block of the pool, so nothing else stays cached."""
    n = sched.kv_manager.num_blocks * 4 - 3
    sched.add_request(make_request(rid, n, max_tokens=1))
    run_until_idle(sched, worker)
    assert not any(b.block_hash in set(hashes(PREFIX)) for b in sched.kv_manager.pool.blocks)


# ---- saving on free ---------------------------------------------------------------------------


def test_freed_cached_blocks_are_held_until_copied_and_named_in_the_next_step():
    sched = tier_scheduler(num_blocks=8)
    worker = FakeTierWorker(hold_copies=True)
    sched.add_request(req("a", PREFIX + [1]))
    tier_step(sched, worker)  # prefill 9 tokens in blocks 0, 1, 2; finishes
    pool = sched.kv_manager.pool
    assert pool.num_free_blocks == 6 and pool.num_held_for_save == 2
    assert sched.has_kv_moves()
    so, _ = tier_step(sched, worker)
    h0, h1 = hashes(PREFIX)
    # Tail first, as the pool freed them; both go to disk (no host tier here).
    assert so.kv_saves == [KVMove(h1, 1, -1, True), KVMove(h0, 0, -1, True)]
    assert pool.num_free_blocks == 6  # not copied yet: still held
    worker.release()
    tier_step(sched, worker)
    assert pool.num_free_blocks == 8 and pool.num_held_for_save == 0
    assert [b.block_id for b in pool.free_queue][-2:] == [1, 0]  # back at the tail, MRU
    assert sched.kv_tier.disk.has(h0) and sched.kv_tier.disk.has(h1)
    assert not sched.has_kv_moves()


def test_a_held_block_is_not_reallocated_before_its_copy():
    sched = tier_scheduler(num_blocks=4)
    worker = FakeTierWorker(hold_copies=True)
    sched.add_request(req("a", PREFIX + [1]))
    tier_step(sched, worker)  # blocks 0, 1 held; 2, 3 free
    sched.add_request(make_request("b", 13, max_tokens=1))  # needs 4 blocks
    so, _ = tier_step(sched, worker)
    assert so.num_scheduled_tokens == {}  # cannot fit: blocks 0 and 1 are being copied
    worker.release()
    tier_step(sched, worker)  # the copies are reported at the end of this step
    so, _ = tier_step(sched, worker)
    assert so.num_scheduled_tokens == {"b": 13}
    assert sorted(so.scheduled_new_reqs[0].block_ids) == [0, 1, 2, 3]


def test_a_pool_hit_on_blocks_held_for_saving_costs_no_free_block():
    # Held blocks are out of the free queue: touching them takes nothing from it, so a
    # request needing exactly the free blocks besides its hits must still fit.
    sched = tier_scheduler(num_blocks=4)
    worker = FakeTierWorker(hold_copies=True)
    sched.add_request(req("a", PREFIX + [1]))
    tier_step(sched, worker)  # blocks 0, 1 held for saving; 2, 3 free
    pool = sched.kv_manager.pool
    assert pool.num_free_blocks == 2 and pool.num_held_for_save == 2
    sched.add_request(req("b", PREFIX + list(range(1, 9))))  # hits 0, 1; needs 2 new
    so, _ = tier_step(sched, worker)
    assert so.num_scheduled_tokens == {"b": 8}
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and new.block_ids[:2] == [0, 1]
    worker.hold_copies = False
    worker.release()
    run_until_idle(sched, worker)
    assert pool.num_free_blocks == 4 and pool.num_held_for_save == 0


def test_a_block_the_tier_already_holds_is_not_saved_again():
    sched = tier_scheduler(num_blocks=8)
    worker = FakeTierWorker()
    sched.add_request(req("a", PREFIX + [1]))
    run_until_idle(sched, worker)
    sched.add_request(req("b", PREFIX + [2]))  # hits a's blocks in the pool
    run_until_idle(sched, worker)
    assert len(worker.submitted_saves) == 2


def test_saves_past_the_held_limit_are_skipped_and_counted():
    sched = tier_scheduler(num_blocks=8, max_held_blocks=1)
    worker = FakeTierWorker()
    sched.add_request(req("a", PREFIX + [1]))
    run_until_idle(sched, worker)
    st = sched.kv_tier.stats()
    assert len(worker.submitted_saves) == 1 and st.saves_skipped == 1


# ---- loading ----------------------------------------------------------------------------------


def test_a_tier_hit_loads_into_new_blocks_while_the_request_waits_in_the_loading_state():
    sched = tier_scheduler(num_blocks=8)
    worker = FakeTierWorker()
    sched.add_request(req("a", PREFIX + [1]))
    run_until_idle(sched, worker)
    evict_pool(sched, worker)
    worker.hold_loads = True
    c = req("c", PREFIX + [5, 6, 7, 8], max_tokens=2)
    d = make_request("d", 4, max_tokens=1)
    sched.add_request(c)
    sched.add_request(d)
    so, _ = tier_step(sched, worker)
    h0, h1 = hashes(PREFIX)
    assert [(m.block_hash, m.host_slot) for m in so.kv_loads] == [(h0, -1), (h1, -1)]
    targets = [m.block_id for m in so.kv_loads]
    assert so.num_scheduled_tokens == {"d": 4}  # c does not hold the step
    assert sched.kv_tier.is_loading(c) and list(sched.waiting) == [c]
    assert c.times.kv_load_started is not None and c.times.kv_load_finished is None
    for _ in range(3):
        so, _ = tier_step(sched, worker)
        assert "c" not in so.num_scheduled_tokens
    worker.release()
    tier_step(sched, worker)  # the loads are reported at the end of this step
    so, _ = tier_step(sched, worker)
    (new,) = so.scheduled_new_reqs
    assert new.request_id == "c" and new.num_computed_tokens == 8
    assert new.block_ids[:2] == targets and so.num_scheduled_tokens == {"c": 4}
    assert c.num_cached_tokens == 8 and c.tier_cached_tokens == {HOST_TIER: 0, DISK_TIER: 8}
    st = sched.kv_tier.stats()
    assert st.hit_tokens == {HOST_TIER: 0, DISK_TIER: 8} and st.bytes_read[DISK_TIER] == 200
    assert sum(st.load_latency_counts) == 1
    assert sched.kv_manager.stats().prefix_hits == 0  # the pool itself had none of it
    run_until_idle(sched, worker)
    assert sched.kv_manager.num_free_blocks == 8


def test_an_abort_in_the_loading_state_releases_the_blocks_once_loaded():
    sched = tier_scheduler(num_blocks=8)
    worker = FakeTierWorker()
    sched.add_request(req("a", PREFIX + [1]))
    run_until_idle(sched, worker)
    evict_pool(sched, worker)
    worker.hold_loads = True
    c = req("c", PREFIX + [5, 6, 7, 8])
    sched.add_request(c)
    so, _ = tier_step(sched, worker)
    targets = [m.block_id for m in so.kv_loads]
    assert sched.abort("c") is c and c.status is RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and sched.has_kv_moves()
    pool = sched.kv_manager.pool
    # The worker may still be writing them: not free until the loads are reported.
    assert all(pool.blocks[t].ref_cnt == 1 for t in targets)
    worker.release()
    run_until_idle(sched, worker)
    assert pool.num_free_blocks == 8
    assert [pool.blocks[t].block_hash for t in targets] == hashes(PREFIX)  # cached for others


def test_a_failed_load_is_computed_instead_and_never_retried():
    sched = tier_scheduler(num_blocks=8)
    worker = FakeTierWorker()
    sched.add_request(req("a", PREFIX + [1]))
    run_until_idle(sched, worker)
    evict_pool(sched, worker)
    h0, h1 = hashes(PREFIX)
    worker.fail_loads = {h1}  # the second block's file is corrupt
    c = req("c", PREFIX + [5, 6, 7, 8])
    sched.add_request(c)
    tier_step(sched, worker)
    so, _ = tier_step(sched, worker)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 4 and so.num_scheduled_tokens == {"c": 8}
    assert c.tier_cached_tokens[DISK_TIER] == 4
    assert not sched.kv_tier.disk.has(h1) and sched.kv_tier.stats().load_failures == 1
    run_until_idle(sched, worker)
    loads = [m.block_hash for m in worker.submitted_loads]
    assert loads.count(h1) == 1


def test_a_salted_prefix_is_never_served_to_another_salt():
    sched = tier_scheduler(num_blocks=8)
    worker = FakeTierWorker()
    sched.add_request(req("a", PREFIX + [1], salt="tenant-a"))
    run_until_idle(sched, worker)
    evict_pool(sched, worker)
    saved = {m.block_hash for m in worker.submitted_saves}
    assert set(hashes(PREFIX, "tenant-a")) <= saved
    b = req("b", PREFIX + [1], salt="tenant-b")
    sched.add_request(b)
    so, _ = tier_step(sched, worker)
    assert so.kv_loads == [] and so.scheduled_new_reqs[0].num_computed_tokens == 0
    c = req("c", PREFIX + [1], salt="tenant-a")
    sched.add_request(c)
    run_until_idle(sched, worker)
    assert c.tier_cached_tokens[DISK_TIER] == 8


def test_a_preempted_request_resumes_from_the_tier():
    sched = tier_scheduler(num_blocks=5, max_num_batched_tokens=64)
    worker = FakeTierWorker()
    a = req("a", PREFIX + [1], max_tokens=8)  # 3 blocks, grows to 4
    b = make_request("b", 7, max_tokens=8)  # 2 blocks
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(12):
        tier_step(sched, worker)
        if b.num_preemptions:
            break
    assert b.num_preemptions == 1
    run_until_idle(sched, worker)
    assert a.status is RequestStatus.FINISHED_LENGTH and b.status is RequestStatus.FINISHED_LENGTH
    assert sched.kv_manager.num_free_blocks == 5


def test_a_request_that_skips_prefix_reads_never_loads():
    sched = tier_scheduler(num_blocks=8)
    worker = FakeTierWorker()
    sched.add_request(req("a", PREFIX + [1]))
    run_until_idle(sched, worker)
    evict_pool(sched, worker)
    scoring = Request("s", PREFIX + [1], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert not scoring.uses_kv_tier
    sched.add_request(scoring)
    so, _ = tier_step(sched, worker)
    assert so.kv_loads == [] and so.num_scheduled_tokens == {"s": 9}


# ---- host tier ------------------------------------------------------------------------------


def test_host_tier_saves_take_slots_write_through_to_disk_and_load_from_the_slot():
    sched = tier_scheduler(num_blocks=8, host_slots=2)
    worker = FakeTierWorker()
    sched.add_request(req("a", PREFIX + [1]))
    run_until_idle(sched, worker)
    h0, h1 = hashes(PREFIX)
    assert worker.submitted_saves == [KVMove(h1, 1, 0, True), KVMove(h0, 0, 1, True)]
    sched.kv_manager.reset_prefix_cache()  # the pool forgets; the tiers do not
    c = req("c", PREFIX + [1])
    sched.add_request(c)
    so, _ = tier_step(sched, worker)
    assert [(m.block_hash, m.host_slot) for m in so.kv_loads] == [(h0, 1), (h1, 0)]
    run_until_idle(sched, worker)
    assert c.tier_cached_tokens == {HOST_TIER: 8, DISK_TIER: 0}
    evict_pool(sched, worker)  # the filler's saves take both slots: h0, h1 leave the host
    tier = sched.kv_tier
    assert not tier.host.has(h0) and tier.disk.has(h0)
    c2 = req("c2", PREFIX + [2])
    sched.add_request(c2)
    so, _ = tier_step(sched, worker)
    assert [(m.block_hash, m.host_slot) for m in so.kv_loads] == [(h0, -1), (h1, -1)]
    run_until_idle(sched, worker)
    assert c2.tier_cached_tokens == {HOST_TIER: 0, DISK_TIER: 8}


def test_a_host_slot_read_by_a_disk_write_is_not_reused_until_written():
    sched = tier_scheduler(num_blocks=8, host_slots=1)
    worker = FakeTierWorker(hold_stores=True)
    sched.add_request(req("a", [1, 2, 3, 4, 5]))  # one full block
    run_until_idle_but_stores(sched, worker)
    (ha,) = hashes([1, 2, 3, 4])
    assert worker.submitted_saves == [KVMove(ha, 0, 0, True)]
    sched.add_request(req("b", [5, 6, 7, 8, 9]))
    run_until_idle_but_stores(sched, worker)
    (hb,) = hashes([5, 6, 7, 8])
    # The only slot is still read by a's disk write: b goes to disk alone.
    assert worker.submitted_saves[1] == KVMove(hb, 2, -1, True)
    worker.release()
    run_until_idle(sched, worker)
    assert sched.kv_tier.host.has(ha) and sched.kv_tier.disk.has(hb)


def run_until_idle_but_stores(sched, worker) -> None:
    for _ in range(50):
        tier_step(sched, worker)
        if not sched.has_unfinished_requests() and not sched.kv_tier._held:
            return
    raise AssertionError("not settled")


# ---- bounds, failures, start-up and drain -------------------------------------------------------


def test_the_disk_tier_never_exceeds_its_capacity_and_deletes_lru_files_first():
    sched = tier_scheduler(num_blocks=8, disk_blocks=3)
    worker = FakeTierWorker()
    first = None
    for i in range(6):
        tokens = [1000 * (i + 1) + t for t in range(9)]
        sched.add_request(req(f"r{i}", tokens))
        while sched.has_unfinished_requests() or sched.has_kv_moves():
            tier_step(sched, worker)
            assert len(worker.disk) * FILE_BYTES <= 3 * FILE_BYTES
            assert sched.kv_tier.disk.used_bytes <= 3 * FILE_BYTES
        first = first or hashes(tokens[:8])
    assert set(first) <= set(worker.deleted)


def test_a_disk_error_switches_the_disk_tier_off_and_serving_goes_on():
    sched = tier_scheduler(num_blocks=8)
    worker = FakeTierWorker()
    sched.add_request(req("a", PREFIX + [1]))
    run_until_idle(sched, worker)
    so = sched.schedule()
    out = KVTierReport(disk_error="[Errno 28] No space left on device")
    from engine.core.step_io import RunnerOutput

    sched.update_from_output(so, RunnerOutput(kv_tier=out))
    tier = sched.kv_tier
    assert tier.disk is None and tier.stats().disk_error.startswith("[Errno 28]")
    evict_pool(sched, worker)
    c = req("c", PREFIX + [1])
    sched.add_request(c)
    so, _ = tier_step(sched, worker)
    assert so.kv_loads == [] and so.num_scheduled_tokens == {"c": 9}
    run_until_idle(sched, worker)
    assert sched.kv_manager.num_free_blocks == 8


def test_the_start_up_listing_keeps_the_newest_files_that_fit_and_deletes_the_rest():
    sched = tier_scheduler(num_blocks=8, disk_blocks=2)
    tier = sched.kv_tier
    listing = [(bytes([i]) * 32, FILE_BYTES, float(i)) for i in range(4)]
    assert tier.load_index(listing) == 2
    assert tier.disk.hashes() == [bytes([2]) * 32, bytes([3]) * 32]  # oldest first
    _, _, deletes = tier.take_moves()
    assert sorted(deletes) == [bytes([0]) * 32, bytes([1]) * 32]


def test_orphaned_files_are_deleted_unless_the_index_holds_the_block():
    """Tensor parallelism: files some ranks hold and others do not come back `orphaned`
    (engine/worker/kv_tier/rank_reports.py); the core, which owns the index, deletes them,
    except a block it holds (present or being saved) by then."""
    sched = tier_scheduler(num_blocks=8, disk_blocks=4)
    tier = sched.kv_tier
    held, stray = bytes([1]) * 32, bytes([2]) * 32
    assert tier.load_index([(held, FILE_BYTES, 1.0)]) == 1
    tier.apply(KVTierReport(orphaned=[held, stray]))
    _, _, deletes = tier.take_moves()
    assert deletes == [stray] and tier.disk.hashes() == [held]


def test_drain_flush_saves_the_pools_cached_blocks_most_recent_first():
    sched = tier_scheduler(num_blocks=8, disk_blocks=64, host_slots=4)
    worker = FakeTierWorker()
    sched.kv_tier.disk.capacity_bytes = 1  # nothing fits on disk while serving
    sched.add_request(req("a", PREFIX + [1]))
    run_until_idle(sched, worker)
    sched.add_request(req("b", [7, 7, 7, 7, 1]))
    run_until_idle(sched, worker)
    sched.kv_tier.disk.capacity_bytes = 64 * FILE_BYTES
    worker.submitted_saves.clear()
    assert sched.kv_tier.flush_pool() == 3
    saves, _, _ = sched.kv_tier.take_moves()
    (hb,) = hashes([7, 7, 7, 7])
    h0, h1 = hashes(PREFIX)
    assert [(m.block_hash, m.to_disk, m.host_slot) for m in saves] == [
        (hb, True, -1),
        (h0, True, -1),
        (h1, True, -1),
    ]
