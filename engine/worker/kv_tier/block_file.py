"""One KV block as a file of the disk tier: a fixed header, then the block's KV, checked.

    offset  size  field
         0     4  magic b"KVTB"
         4     2  format version (FORMAT_VERSION)
         6     2  header length (HEADER_BYTES)
         8    32  fingerprint digest (the model, dtype, layout ... the file belongs to)
        40    32  block hash (the prefix-cache key, extra keys and all)
        72     8  payload length in bytes
        80     8  xxh3-64 of the payload
        88     8  zero
        96     -  payload: layer 0's [2, block_size, kv_heads, head_dim], layer 1's, ...

Everything is little-endian. A file whose magic, version, length, fingerprint or hash is not
exactly what the reader expects is not ours to parse (`BlockFileError`); a payload whose
checksum differs is corrupt. Either way the reader computes the block instead. xxh3-64 reads
~5 GB/s on one core and releases the GIL (crc32 ~1 GB/s, SHA-256 ~0.8): a checksum against
torn writes and bit rot, not against an attacker (the directory is the server's own).
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"KVTB"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHH32s32sQQ8x")
HEADER_BYTES = _HEADER.size  # 96
SUFFIX = ".kvb"


class BlockFileError(ValueError):
    """The bytes are not a valid block file for what the reader expects."""


def file_bytes(payload_bytes: int) -> int:
    """Size of a block's file."""
    return HEADER_BYTES + payload_bytes


def checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(fingerprint: bytes, block_hash: bytes, payload: memoryview | bytes) -> bytes:
    return _HEADER.pack(
        MAGIC, FORMAT_VERSION, HEADER_BYTES, fingerprint, block_hash, len(payload),
        checksum(payload),
    )  # fmt: skip


def check(data: memoryview, fingerprint: bytes, block_hash: bytes, payload_bytes: int) -> None:
    """Raises `BlockFileError` unless `data` is exactly one intact file of this block."""
    if len(data) < HEADER_BYTES:
        raise BlockFileError(f"truncated: {len(data)} bytes, no whole header")
    magic, version, hlen, fp, h, plen, sum_ = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION or hlen != HEADER_BYTES:
        raise BlockFileError(f"not format {FORMAT_VERSION} (magic {magic!r}, version {version})")
    if fp != fingerprint:
        raise BlockFileError("written for another model fingerprint")
    if h != block_hash:
        raise BlockFileError("holds another block")
    if plen != payload_bytes or len(data) != HEADER_BYTES + payload_bytes:
        raise BlockFileError(
            f"truncated or padded: {len(data)} bytes, expected {file_bytes(payload_bytes)}"
        )
    if checksum(data[HEADER_BYTES:]) != sum_:
        raise BlockFileError("checksum mismatch")
