"""What a disk tier file's KV depends on besides its block hash: the model fingerprint.

A block hash covers tokens, the prefix before them and the extra keys (cache salt, LoRA
adapter content), not the model. Files are therefore kept under one directory per
fingerprint, which covers everything else that changes a block's bytes or their meaning:

- the weights' identity: each weight file's name, size and a SHA-256 over its first MiB
  (the safetensors header: names, dtypes, shapes) and 16 chunks of 64 KiB spread over the
  rest, plus config.json (so a fine-tune of the same shapes differs; reading 2 MiB per file
  keeps start-up fast where hashing 16 GB would take a minute),
- how they are run: the model settings that are not names or limits (dtype, quantization and
  whatever such field `ModelConfig` gains), the resolved run dtype,
- the KV cache: its dtype, block size, layout, layers, KV heads and head size of this rank,
- tensor parallelism: the size and this rank (one directory, so one file, per rank),
- the formats: the file format version and the block hash scheme's version.

Another model, dtype or block size on the same directory finds another fingerprint and never
reads these files (one log line says so).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from engine.core.kv_cache.hashing import HASH_VERSION
from engine.worker.kv_tier.block_file import FORMAT_VERSION

# The KV layout per layer (engine/worker/attention): [num_blocks, 2, block_size, heads, dim].
LAYOUT = "paged-kv:[blocks,2,block_size,kv_heads,head_dim]"
_HEAD_BYTES = 1 << 20
_CHUNK_BYTES = 64 << 10
_CHUNKS = 16
# ModelConfig fields that name or bound the model but never change a block's KV.
_NOT_KV = frozenset({"path", "served_name", "tokenizer", "max_model_len", "seed"})
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def file_identity(path: Path) -> str:
    """SHA-256 over the file's size, its first MiB and 16 chunks spread over the rest."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(_HEAD_BYTES))
        if size > _HEAD_BYTES:
            step = (size - _HEAD_BYTES) // _CHUNKS
            for i in range(_CHUNKS):
                f.seek(_HEAD_BYTES + i * step)
                h.update(f.read(_CHUNK_BYTES))
    return h.hexdigest()


def weights_identity(model_dir: Path) -> str:
    """One digest of config.json and every weight file in the directory."""
    h = hashlib.sha256()
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and (
        p.name == "config.json" or p.suffix in _WEIGHT_SUFFIXES))  # fmt: skip
    for p in files:
        h.update(p.name.encode() + b"\0" + file_identity(p).encode() + b"\0")
    return h.hexdigest()


def fingerprint_fields(
    *,
    weights: str,
    model_config: Any,
    run_dtype: str,
    kv_dtype: str,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    tp_size: int,
    tp_rank: int,
) -> dict[str, Any]:
    """The fingerprint's fields as a JSON-ready dict (also written as fingerprint.json)."""
    model = {k: v for k, v in sorted(dataclasses.asdict(model_config).items()) if k not in _NOT_KV}
    return {
        "format_version": FORMAT_VERSION,
        "hash_version": HASH_VERSION,
        "weights": weights,
        "model": json.loads(json.dumps(model, default=str)),
        "run_dtype": run_dtype,
        "kv_dtype": kv_dtype,
        "block_size": block_size,
        "layout": LAYOUT,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "tensor_parallel_size": tp_size,
        "tensor_parallel_rank": tp_rank,
    }


def fingerprint_digest(fields: dict[str, Any]) -> bytes:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()
