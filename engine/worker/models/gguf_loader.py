"""GGUF checkpoints: their config and tokenizer once into a small cached directory.

The weights are read from the GGUF file itself at every load, by the `gguf` package's
reader (engine/worker/quant/gguf_tensors.py), and kept in their block formats; only the
config (config.json, generation_config.json) and the tokenizer with its chat template,
which transformers converts from the GGUF's metadata in a few seconds, are written once to

    $APPLIANCE_CACHE/models/<stem>-<hash>      or   ~/.cache/appliance/models/<stem>-<hash>

where the hash covers the file's absolute path, size and mtime, so a changed file converts
again (a few MB: no weights). The directory appears atomically: everything is written to a
temporary sibling that is renamed into place at the end, so a killed conversion never
leaves a half directory. `gguf_source(model_dir)` names the file the weights come from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CACHE_ENV = "APPLIANCE_CACHE"
_DONE_MARKER = "appliance_conversion.json"
_INDEX = "gguf_tensors.json"


def gguf_cache_root() -> Path:
    """Root for converted models; read from the environment when called, never at import."""
    base = os.environ.get(CACHE_ENV)
    root = Path(base) if base else Path.home() / ".cache" / "appliance"
    return root / "models"


def converted_dir_for(gguf_path: Path, cache_root: Path | None = None) -> Path:
    """The cache directory a GGUF file converts to (it may not exist yet)."""
    gguf_path = gguf_path.resolve()
    st = gguf_path.stat()
    key = f"{gguf_path}:{st.st_size}:{st.st_mtime_ns}:metadata-only".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return (cache_root or gguf_cache_root()) / f"{gguf_path.stem}-{digest}"


def is_converted(model_dir: Path) -> bool:
    return all((model_dir / f).is_file() for f in (_DONE_MARKER, "config.json", _INDEX))


def convert_gguf(gguf_path: str | Path, cache_root: Path | None = None) -> Path:
    """Return an HF-format directory for `gguf_path`, converting it on first use."""
    gguf_path = Path(gguf_path).resolve()
    final = converted_dir_for(gguf_path, cache_root)
    if is_converted(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    logger.info("reading %s's config and tokenizer into %s (once)", gguf_path, final)
    try:
        _write_hf_dir(gguf_path, tmp)
        (tmp / _DONE_MARKER).write_text(
            json.dumps(
                {
                    "source": str(gguf_path),
                    "size": gguf_path.stat().st_size,
                    "mtime_ns": gguf_path.stat().st_mtime_ns,
                    "seconds": round(time.perf_counter() - start, 2),
                },
                indent=2,
            )
        )
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_converted(final):  # a broken leftover: replace it
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():  # failed, or another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return final


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory's weights are read from (None: not a GGUF's)."""
    marker = model_dir / _DONE_MARKER
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["source"])


def gguf_index(model_dir: Path) -> dict:
    """The tensor index recorded at conversion (engine/worker/quant/gguf_tensors.py)."""
    return json.loads((model_dir / _INDEX).read_text())


def _write_hf_dir(gguf_path: Path, out: Path) -> None:
    """config.json, generation_config.json and tokenizer files into `out` (no weights).

    The config records float32 (the dequantized values are exact there) and the HF class
    name our registry knows; `model.dtype` picks the run dtype at load time."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from engine.worker.quant.gguf_tensors import index_gguf

    folder, name = str(gguf_path.parent), gguf_path.name
    index = index_gguf(gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    out.mkdir(parents=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = torch.float32
    config.save_pretrained(str(out))
    gen = GenerationConfig.from_model_config(config)
    if tokenizer.eos_token_id is not None and gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    gen.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / _INDEX).write_text(json.dumps(index))


def _remove_stale_tmp_dirs(final: Path) -> None:
    """Delete temporary dirs of conversions whose process is gone (killed mid-way)."""
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit(".tmp-", 1)[1].split("-")[0])
            os.kill(pid, 0)
        except (ValueError, IndexError, ProcessLookupError):
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            pass  # alive, owned by someone else
