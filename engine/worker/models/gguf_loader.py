"""GGUF checkpoints: dequantize once into a cached HF-format directory, then load that.

transformers reads the GGUF's config, tokenizer (with chat template) and tensors, undoing
llama.cpp's q/k row permutation. That takes seconds to tens of seconds, so the result is
written once to

    $APPLIANCE_CACHE/models/<stem>-<hash>      or   ~/.cache/appliance/models/<stem>-<hash>

where the hash covers the file's absolute path, size and mtime, so a changed file converts
again. The directory appears atomically: everything is written to a temporary sibling that
is renamed into place at the end, so a killed conversion never leaves a half directory.
Weights are kept in float32: dequantized values are exact there, and `model.dtype` picks
the run dtype at load time.
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


def gguf_cache_root() -> Path:
    """Root for converted models; read from the environment when called, never at import."""
    base = os.environ.get(CACHE_ENV)
    root = Path(base) if base else Path.home() / ".cache" / "appliance"
    return root / "models"


def converted_dir_for(gguf_path: Path, cache_root: Path | None = None) -> Path:
    """The cache directory a GGUF file converts to (it may not exist yet)."""
    gguf_path = gguf_path.resolve()
    st = gguf_path.stat()
    key = f"{gguf_path}:{st.st_size}:{st.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return (cache_root or gguf_cache_root()) / f"{gguf_path.stem}-{digest}"


def is_converted(model_dir: Path) -> bool:
    return (model_dir / _DONE_MARKER).is_file() and (model_dir / "config.json").is_file()


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
    logger.info("converting %s to %s (once; dequantizing to float32)", gguf_path, final)
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


def _write_hf_dir(gguf_path: Path, out: Path) -> None:
    """config.json, generation_config.json, model.safetensors and tokenizer files into `out`.

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the state dict and the
    config are written directly (a tied lm_head is dropped: it shares the embedding).
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    out.mkdir(parents=True)
    config = model.config
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(str(out))
    gen = model.generation_config
    if tokenizer.eos_token_id is not None and gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    gen.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


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
