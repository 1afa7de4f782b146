"""The disk tier's files: one per block, addressed by its hash, under a fingerprint directory.

    <cache.disk_tier_dir>/
      kv-<fingerprint>/             one per model, dtype, block size, layout, TP rank ...
        fingerprint.json            what the digest covers, for people and mismatch logs
        tmp/                        files being written (renamed into place when whole)
        3f/3f9a...e1.kvb            block 3f9a...e1 (256 fan-out directories)

Writes are atomic: the file is written whole under tmp/ and renamed over its final name, so
a reader (this process, a restarted one, another replica on a shared volume) sees either no
file or a whole one, and two replicas writing the same block write the same bytes. Readers
check everything (`block_file.check`); eviction is `unlink`, which never disturbs a reader
that already opened the file (POSIX keeps its inode), and a reader that finds the file gone
computes the block. No per-block fsync: a crash can leave a torn file, which its checksum
catches; this is a cache.

Every file-system call goes through `FileOps`, the seam where tests inject ENOSPC or EIO.
`probe` proves at start-up that the directory takes a write, an fsync, a rename over an
existing file and a read back; the engine refuses to start (naming the key) otherwise.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

from engine.worker.kv_tier.block_file import HEADER_BYTES, SUFFIX, BlockFileError, check

logger = logging.getLogger(__name__)

# Temporary files older than this at start-up were left by a process that died mid-write.
STALE_TMP_S = 600.0
# I/O errors after which the disk tier is off for the rest of the run (vs one bad file).
FATAL_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EROFS})
_ALIGN = 4096  # O_DIRECT buffers, offsets and lengths


class DiskTierUnusable(Exception):
    """The directory cannot hold the tier (not writable, no atomic rename, ...)."""


class FileOps:
    """The file-system calls of the disk tier, one method each (the fault-injection seam)."""

    def write_new(self, path: str, chunks: list[memoryview | bytes]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def fsync_path(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def read_into(self, path: str, buf: memoryview, direct: bool = False) -> int:
        """Reads the file into `buf` (at most its length); returns the bytes read. `direct`:
        O_DIRECT (buf must be page-aligned and a multiple of 4096 long)."""
        flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
        fd = os.open(path, flags)
        try:
            n = 0
            while n < len(buf):
                got = os.readv(fd, [buf[n:]])
                if got == 0:
                    break
                n += got
            return n
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def touch(self, path: str) -> None:
        os.utime(path)

    def scandir(self, path: str) -> list[os.DirEntry]:
        with os.scandir(path) as it:
            return list(it)


@dataclass(frozen=True)
class ScanEntry:
    block_hash: bytes
    nbytes: int
    mtime: float


class DiskStore:
    """One fingerprint directory of block files. Thread-safe where it matters: one writer
    thread, any number of reader threads (each with its own buffer)."""

    def __init__(
        self,
        root: str | Path,
        fingerprint: bytes,
        fingerprint_fields: dict,
        payload_bytes: int,
        *,
        direct_io: bool = False,
        ops: FileOps | None = None,
    ):
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.fields = fingerprint_fields
        self.payload_bytes = payload_bytes
        self.file_bytes = HEADER_BYTES + payload_bytes
        self.dir = self.root / ("kv-" + fingerprint.hex()[:24])
        self.tmp = self.dir / "tmp"
        self.ops = ops or FileOps()
        self.direct_io = direct_io
        # Temporary names must never collide across replicas on a shared volume, whose
        # processes may well have the same pid (each container's own pid 1).
        self._nonce = os.urandom(8).hex()
        self._seq = 0

    # ---- start-up ------------------------------------------------------------------------
    def open(self) -> None:
        """Creates the directories, removes stale temporary files, records the fingerprint
        and runs the probe; `DiskTierUnusable` with the reason when any of it fails."""
        try:
            self.tmp.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp()
            self._write_fingerprint()
            self.probe()
        except OSError as e:
            raise DiskTierUnusable(f"{self.root}: {e.strerror or e} ({type(e).__name__})") from e
        if self.direct_io and not self._direct_works():
            logger.warning(
                "kv disk tier: %s refuses O_DIRECT reads; reading through the page cache",
                self.root,
            )
            self.direct_io = False

    def probe(self) -> None:
        """Write, fsync, rename over an existing file, read back: what the tier relies on."""
        stem = str(self.tmp / f"probe-{self._nonce}-{time.monotonic_ns()}")
        data = os.urandom(4096)
        a, b = stem + ".a", stem + ".b"
        try:
            self.ops.write_new(a, [data])
            self.ops.fsync_path(a)
            self.ops.write_new(b, [b"old"])
            self.ops.replace(a, b)
            buf = bytearray(8192)
            n = self.ops.read_into(b, memoryview(buf))
            if bytes(buf[:n]) != data:
                raise DiskTierUnusable(
                    f"{self.root}: a file renamed over another did not read back as written "
                    "(no atomic rename on this filesystem)"
                )
        finally:
            for p in (a, b):
                try:
                    self.ops.unlink(p)
                except OSError:
                    pass

    def _direct_works(self) -> bool:
        path = str(self.tmp / f"direct-{self._nonce}-{time.monotonic_ns()}")
        try:
            self.ops.write_new(path, [b"\0" * _ALIGN])
            buf = mmap.mmap(-1, _ALIGN)
            return self.ops.read_into(path, memoryview(buf), direct=True) == _ALIGN
        except OSError:
            return False
        finally:
            try:
                self.ops.unlink(path)
            except OSError:
                pass

    def _remove_stale_tmp(self) -> None:
        cutoff = time.time() - STALE_TMP_S
        for entry in self.ops.scandir(str(self.tmp)):
            try:
                if entry.stat().st_mtime < cutoff:
                    self.ops.unlink(entry.path)
            except OSError:
                pass

    def _write_fingerprint(self) -> None:
        path = self.dir / "fingerprint.json"
        text = json.dumps(self.fields, sort_keys=True, indent=1) + "\n"
        if path.exists() and path.read_text() == text:
            return
        tmp = str(self.tmp / f"fingerprint-{self._nonce}-{time.monotonic_ns()}")
        self.ops.write_new(tmp, [text.encode()])
        self.ops.replace(tmp, str(path))

    def other_fingerprints(self) -> dict[str, list[str]]:
        """The root's other fingerprint directories, each with the fields that differ from
        ours (from its fingerprint.json; ["unknown"] when unreadable). Not ours to read.
        The other tensor-parallel ranks of this very engine (only `tensor_parallel_rank`
        differs) are not "other": they are left out."""
        out: dict[str, list[str]] = {}
        try:
            entries = self.ops.scandir(str(self.root))
        except OSError:
            return out
        for entry in entries:
            if not entry.name.startswith("kv-") or entry.name == self.dir.name:
                continue
            try:
                theirs = json.loads((Path(entry.path) / "fingerprint.json").read_text())
                diff = sorted(k for k in self.fields.keys() | theirs.keys()
                              if self.fields.get(k) != theirs.get(k))  # fmt: skip
            except (OSError, ValueError):
                diff = ["unknown"]
            if diff != ["tensor_parallel_rank"]:
                out[entry.name] = diff
        return out

    # ---- files ---------------------------------------------------------------------------
    def path(self, block_hash: bytes) -> str:
        hx = block_hash.hex()
        return str(self.dir / hx[:2] / (hx + SUFFIX))

    def write(self, block_hash: bytes, header: bytes, payload: memoryview) -> None:
        """Writes the block's file atomically (OSError from the file system as it comes)."""
        final = self.path(block_hash)
        self._seq += 1
        tmp = str(self.tmp / f"{block_hash.hex()}.{self._nonce}.{self._seq}.tmp")
        try:
            self.ops.write_new(tmp, [header, payload])
            try:
                self.ops.replace(tmp, final)
            except FileNotFoundError:  # its fan-out directory does not exist yet
                os.makedirs(os.path.dirname(final), exist_ok=True)
                self.ops.replace(tmp, final)
        except BaseException:
            try:
                self.ops.unlink(tmp)
            except OSError:
                pass
            raise

    def read(self, block_hash: bytes, buf: memoryview) -> memoryview:
        """The verified payload of the block's file, read into `buf` (see `read_buffer`).
        FileNotFoundError when it is gone; BlockFileError when it is not a whole, intact file
        of this block and fingerprint (then it is also deleted: it can only be junk)."""
        path = self.path(block_hash)
        n = self.ops.read_into(path, buf, direct=self.direct_io)
        data = buf[:n]
        try:
            check(data, self.fingerprint, block_hash, self.payload_bytes)
        except BlockFileError:
            self.delete(block_hash)
            raise
        try:
            self.ops.touch(path)  # recency for restarts and other replicas' LRU
        except OSError:
            pass
        return data[HEADER_BYTES:]

    def read_buffer(self) -> memoryview:
        """A buffer for `read`: page-aligned, one byte longer than a file (so a padded file
        shows as too long), rounded up to 4096 for O_DIRECT."""
        size = -(-(self.file_bytes + 1) // _ALIGN) * _ALIGN
        return memoryview(mmap.mmap(-1, size))

    def delete(self, block_hash: bytes) -> None:
        try:
            self.ops.unlink(self.path(block_hash))
        except FileNotFoundError:
            pass

    def scan(self) -> list[ScanEntry]:
        """Every block file of this fingerprint (no file is read: names and stat only).
        Files of the wrong size are not ours, or torn: they are deleted."""
        out: list[ScanEntry] = []
        try:
            subdirs = [e for e in self.ops.scandir(str(self.dir)) if len(e.name) == 2]
        except FileNotFoundError:
            return out
        for sub in subdirs:
            try:
                entries = self.ops.scandir(sub.path)
            except OSError:
                continue
            for entry in entries:
                name = entry.name
                if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
                    continue
                try:
                    h = bytes.fromhex(name[:64])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                if st.st_size != self.file_bytes:
                    try:
                        self.ops.unlink(entry.path)
                    except OSError:
                        pass
                    continue
                out.append(ScanEntry(h, st.st_size, st.st_mtime))
        return out


def is_fatal(e: OSError) -> bool:
    """An error that means the disk cannot serve the tier (full, failing, read-only)."""
    return e.errno in FATAL_ERRNOS
