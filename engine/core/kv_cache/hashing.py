"""Chained content hashes of full KV blocks, the keys of the prefix cache.

The hash of block ``i`` covers its own tokens *and*, through ``parent_hash``, every token
before it, so equal hashes mean equal prefixes and a prefix lookup is a walk of exact-match
dict probes::

    h0 = H(ROOT, extra_keys, tokens[0:bs])
    h1 = H(h0,   extra_keys, tokens[bs:2*bs])      ...

``H`` is SHA-256 over a compact, unambiguous byte string: the 32-byte parent digest, the
prefix-free encoding of the extra keys (`encode_extra_keys`), then the tokens as
little-endian int64. Collisions: the digest is 256 bits, so even 2**40 cached blocks collide
with probability about 2**-177; no one can construct one on purpose either (unlike Python's
``hash()`` or a 64-bit xxhash, which a client could attack to read another prompt's KV).
So a hit is trusted without comparing tokens, which would cost memory on every cached block.

``extra_keys`` is whatever else the KV depends on besides the tokens (`Request.cache_keys`):
the request's ``cache_salt`` (tenants that must not share cache entries), then its LoRA
adapter's content key (adapters change every layer's K/V).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import sha256

BlockHash = bytes

# The scheme's version: whatever keeps hashes of one run (the KV tiers' files) meaningful to
# another. Bump it when anything below changes what a hash covers or how.
HASH_VERSION = 1

# Parent of a request's first block: a fixed 32-byte value keeps the layout fixed-width.
ROOT_HASH: BlockHash = sha256(b"engine.kv_cache:root").digest()


def encode_extra_keys(keys: Sequence[str | int | bytes] = ()) -> bytes:
    """Prefix-free encoding of extra hash keys: a count byte, then per key a type tag, a
    4-byte length and the payload. No keys encodes as ``b"\\x00"``.

    A key's position is part of its identity: callers append new kinds of keys at the end.
    """
    if not keys:
        return b"\x00"
    if len(keys) > 255:
        raise ValueError("extra_keys: at most 255 keys")
    parts = [bytes((len(keys),))]
    for key in keys:
        if isinstance(key, int):
            tag, payload = b"i", int(key).to_bytes(16, "little", signed=True)
        elif isinstance(key, str):
            tag, payload = b"s", key.encode("utf-8")
        elif isinstance(key, bytes):
            tag, payload = b"b", key
        else:
            raise TypeError(f"extra_keys: unsupported key type {type(key).__name__}")
        parts += (tag, len(payload).to_bytes(4, "little"), payload)
    return b"".join(parts)


NO_EXTRA_KEYS = encode_extra_keys()


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: bytes = NO_EXTRA_KEYS,
) -> BlockHash:
    """Hash of one full block: ``H(parent_hash or ROOT_HASH, extra_keys, token_ids)``.

    ``extra_keys`` must come from `encode_extra_keys`.
    """
    h = sha256(parent_hash or ROOT_HASH)
    h.update(extra_keys)
    h.update(array("q", token_ids))
    return h.digest()


def hash_block_chain(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: bytes = NO_EXTRA_KEYS,
) -> list[BlockHash]:
    """Hashes of the consecutive full blocks of ``token_ids`` (a trailing partial block is
    ignored), chained from ``parent_hash``. Equal to calling `hash_block_tokens` per block,
    but converts the tokens once: about 1-2 µs per block.
    """
    n = len(token_ids) // block_size
    if n == 0:
        return []
    tokens = array("q", token_ids[: n * block_size])
    out: list[BlockHash] = []
    parent = parent_hash or ROOT_HASH
    with memoryview(tokens) as mv:
        for start in range(0, n * block_size, block_size):
            h = sha256(parent)
            h.update(extra_keys)
            h.update(mv[start : start + block_size])
            parent = h.digest()
            out.append(parent)
    return out
