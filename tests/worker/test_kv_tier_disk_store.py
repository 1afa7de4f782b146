"""DiskStore and the block file format: atomic content-addressed files, verified reads,
eviction safe against a reader that already opened the file, replicas writing the same
block, the start-up probe, scans that read no block, and files of other formats refused."""

from __future__ import annotations

import os
import threading

import pytest

from engine.worker.kv_tier.block_file import HEADER_BYTES, BlockFileError, encode_header
from engine.worker.kv_tier.disk_store import DiskStore, DiskTierUnusable, FileOps

FP = b"\x01" * 32
PAYLOAD = 3000


def _store(root, ops: FileOps | None = None, fp: bytes = FP) -> DiskStore:
    s = DiskStore(root, fp, {"block_size": 16, "fp": fp.hex()}, PAYLOAD, ops=ops)
    s.open()
    return s


def _write(s: DiskStore, h: bytes, fill: int) -> bytes:
    payload = bytes([fill]) * PAYLOAD
    s.write(h, encode_header(s.fingerprint, h, payload), memoryview(payload))
    return payload


def test_a_written_block_reads_back_verified_and_scans_without_reading(tmp_path):
    s = _store(tmp_path)
    h = os.urandom(32)
    payload = _write(s, h, 7)
    assert bytes(s.read(h, s.read_buffer())) == payload
    (entry,) = s.scan()
    assert entry.block_hash == h and entry.nbytes == HEADER_BYTES + PAYLOAD
    assert list(s.tmp.iterdir()) == []  # nothing left half-written


@pytest.mark.parametrize(
    "damage", ["truncate", "pad", "flip_payload", "other_version", "other_fingerprint", "swap"]
)
def test_a_file_that_is_not_exactly_this_block_is_refused_and_deleted(damage, tmp_path):
    s = _store(tmp_path)
    h, other = os.urandom(32), os.urandom(32)
    _write(s, h, 1)
    _write(s, other, 2)
    path = s.path(h)
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[:-1]
    elif damage == "pad":
        data += b"\0"
    elif damage == "flip_payload":
        data[HEADER_BYTES + 10] ^= 0x80
    elif damage == "other_version":
        data[4] = 9
    elif damage == "other_fingerprint":
        data[8] ^= 0xFF
    else:  # another block's (valid) file under this name
        data = bytearray(open(s.path(other), "rb").read())
    open(path, "wb").write(bytes(data))
    with pytest.raises(BlockFileError):
        s.read(h, s.read_buffer())
    assert not os.path.exists(path)  # junk in our namespace is removed
    with pytest.raises(FileNotFoundError):  # the next reader finds no file: computes it
        s.read(h, s.read_buffer())


class _UnlinkAfterOpen(FileOps):
    """Another replica evicts the file between our open and our read."""

    def read_into(self, path, buf, direct=False):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.unlink(path)
            n = 0
            while n < len(buf):
                got = os.readv(fd, [buf[n:]])
                if got == 0:
                    break
                n += got
            return n
        finally:
            os.close(fd)


def test_eviction_never_disturbs_a_reader_that_opened_the_file(tmp_path):
    s = _store(tmp_path, ops=_UnlinkAfterOpen())
    h = os.urandom(32)
    payload = _write(s, h, 5)
    assert bytes(s.read(h, s.read_buffer())) == payload
    assert not os.path.exists(s.path(h))


def test_two_replicas_writing_the_same_block_leave_one_whole_file(tmp_path):
    a, b = _store(tmp_path), _store(tmp_path)
    h = os.urandom(32)
    errors = []

    def writer(s: DiskStore) -> None:
        try:
            for _ in range(50):
                _write(s, h, 3)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for _ in range(50):  # a reader meanwhile sees no file or a whole one, never a torn one
        try:
            assert bytes(a.read(h, a.read_buffer())) == bytes([3]) * PAYLOAD
        except FileNotFoundError:
            pass
    for t in threads:
        t.join()
    assert errors == []
    assert bytes(b.read(h, b.read_buffer())) == bytes([3]) * PAYLOAD


def test_the_probe_refuses_a_directory_without_atomic_rename(tmp_path):
    class NoRename(FileOps):
        def replace(self, src, dst):
            raise OSError(18, "Invalid cross-device link")

    with pytest.raises(DiskTierUnusable, match="cross-device"):
        _store(tmp_path, ops=NoRename())


def test_other_fingerprints_are_named_with_what_differs(tmp_path):
    _store(tmp_path, fp=b"\x02" * 32)
    ours = _store(tmp_path)
    (theirs,) = ours.other_fingerprints().items()
    assert theirs[0] == "kv-" + ("02" * 12) and theirs[1] == ["fp"]


def test_a_scan_deletes_files_of_the_wrong_size(tmp_path):
    s = _store(tmp_path)
    h = os.urandom(32)
    _write(s, h, 1)
    with open(s.path(h), "ab") as f:
        f.write(b"x")
    assert s.scan() == [] and not os.path.exists(s.path(h))


def test_direct_reads_work_or_fall_back(tmp_path):
    s = DiskStore(tmp_path, FP, {}, PAYLOAD, direct_io=True)
    s.open()  # O_DIRECT where the filesystem takes it, else buffered (one warning)
    h = os.urandom(32)
    payload = _write(s, h, 9)
    assert bytes(s.read(h, s.read_buffer())) == payload
