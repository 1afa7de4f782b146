"""Under tensor parallelism the core hears of a KV tier move only once every rank did it
(engine/worker/kv_tier/rank_reports.py): copies, stores, loads and scans of the shared
directory are merged across the ranks' reports, a failure on any rank fails the move, and
files only some ranks wrote are handed back for deletion."""

from __future__ import annotations

from engine.core.step_io import DISK_TIER, HOST_TIER, KVTierReport
from engine.worker.kv_tier.rank_reports import RankReportMerger

H1, H2, H3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16


def test_a_copy_counts_once_every_rank_copied_it():
    m = RankReportMerger(2)
    m.add(0, KVTierReport(copied=[5, 6]))
    assert m.take() is None  # rank 1 still reads blocks 5 and 6
    m.add(1, KVTierReport(copied=[6]))
    assert m.take().copied == [6]
    m.add(1, KVTierReport(copied=[5]))
    m.add(0, KVTierReport(copied=[5]))  # block 5 saved again after it was reused
    assert m.take().copied == [5]
    m.add(1, KVTierReport(copied=[5]))
    assert m.take().copied == [5]


def test_a_store_fails_if_any_rank_failed_and_the_written_shares_become_orphans():
    m = RankReportMerger(3)
    m.add(0, KVTierReport(stored=[(H1, DISK_TIER), (H2, DISK_TIER), (H3, HOST_TIER)]))
    m.add(1, KVTierReport(stored=[(H1, DISK_TIER)], store_failed=[(H2, DISK_TIER)]))
    assert m.take() is None
    m.add(
        2, KVTierReport(stored=[(H1, DISK_TIER), (H2, DISK_TIER)], store_failed=[(H3, HOST_TIER)])
    )
    out = m.take()
    assert out.stored == [(H1, DISK_TIER)]
    assert out.store_failed == [(H2, DISK_TIER)]
    assert out.orphaned == [H2]  # ranks 0 and 2 hold its file
    m.add(1, KVTierReport(stored=[(H3, HOST_TIER)]))  # H3 waited for rank 1
    out = m.take()
    assert out.store_failed == [(H3, HOST_TIER)]
    assert out.orphaned == []  # a host slot is no file


def test_a_load_is_done_when_every_rank_filled_its_share_and_fails_if_one_did_not():
    m = RankReportMerger(2)
    m.add(0, KVTierReport(loaded=[3, 4]))
    m.add(1, KVTierReport(load_failed=[(4, "bad file: checksum")], loaded=[3]))
    out = m.take()
    assert out.loaded == [3]
    assert out.load_failed == [(4, "rank 1: bad file: checksum")]


def test_another_replicas_file_counts_once_every_rank_sees_it_and_one_removal_drops_it():
    m = RankReportMerger(2)
    m.add(1, KVTierReport(scan_added=[(H1, 100, 5.0), (H2, 100, 6.0)]))
    assert m.take() is None
    m.add(0, KVTierReport(scan_added=[(H1, 100, 7.0)], scan_removed=[H2]))
    out = m.take()
    assert out.scan_added == [(H1, 100, 7.0)]
    assert out.scan_removed == [H2]
    m.add(0, KVTierReport(scan_added=[(H2, 100, 8.0)]))  # rank 1's sighting was dropped
    assert m.take() is None


def test_the_first_disk_error_of_any_rank_switches_the_disk_off():
    m = RankReportMerger(2)
    m.add(1, KVTierReport(disk_error="OSError: [Errno 28] No space left on device"))
    m.add(0, KVTierReport(disk_error="later"))
    assert m.take().disk_error == "rank 1: OSError: [Errno 28] No space left on device"


def test_the_index_takes_blocks_every_rank_holds_and_deletes_the_rest():
    m = RankReportMerger(2)
    whole = m.seed_listings([[(H1, 100, 1.0), (H2, 100, 2.0)], [(H1, 100, 3.0), (H3, 100, 4.0)]])
    assert whole == [(H1, 100, 3.0)]
    assert sorted(m.take().orphaned) == [H2, H3]
