"""Paged KV cache bookkeeping, pure Python (no torch): which physical block holds which
tokens of which request, and which full blocks can be shared through the prefix cache.

- `hashing`: chained SHA-256 block hashes, the prefix-cache keys.
- `block_pool`: physical blocks, ref counts, the LRU free queue, the hash -> block map.
- `manager`: `KVCacheManager`, per-request block tables; the scheduler's only KV interface.
"""

from engine.core.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine.core.kv_cache.hashing import (
    BlockHash,
    encode_extra_keys,
    hash_block_chain,
    hash_block_tokens,
)
from engine.core.kv_cache.manager import BlockCopy, KVCacheManager, KVCacheStats

__all__ = [
    "BlockCopy",
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "KVCacheStats",
    "encode_extra_keys",
    "hash_block_chain",
    "hash_block_tokens",
]
