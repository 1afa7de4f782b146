"""The default model as a float safetensors checkpoint that every engine reads alike.

The default SmolLM2 ships as a Q4_1 GGUF, which ours now reads in its block formats from a
metadata-only directory (engine/worker/models/gguf_loader.py). A peer such as vLLM CPU reads
a safetensors directory, and a same-model comparison needs one both read: this writes the
GGUF dequantized by `gguf.quants` (engine/worker/quant/gguf_tensors.py, the values
transformers reads) as float32 `model.safetensors` beside the converted config and
tokenizer, once, under bench's models dir (`<name>-f32`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bench.workloads import MODELS_DIR, smollm2_dir

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja", "special_tokens_map.json")  # fmt: skip


def smollm2_float_dir() -> Path:
    """bench/.models/smollm2-f32 (built on first use: a few seconds, ~540 MB)."""
    out = MODELS_DIR / "smollm2-f32"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from engine.worker.models.gguf_loader import gguf_index, gguf_source
    from engine.worker.quant.gguf_tensors import read_gguf_tensors

    src = smollm2_dir()
    gguf = gguf_source(src)
    if gguf is None:  # already a float checkpoint
        return src
    tmp = MODELS_DIR / ".smollm2-f32.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in FILES:
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)
    cfg = AutoConfig.from_pretrained(str(src))
    tensors = {
        name: t.to(torch.float32).contiguous()
        for name, t, _ in read_gguf_tensors(gguf, gguf_index(src), cfg, keep_blocks=False)
    }
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
