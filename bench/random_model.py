"""Random-weight models of a real shape, built directly in device memory (nothing on disk).

The GPU check (scripts/gpu_check.sh) measures Llama-3-8B's shape in bf16 without a checkpoint:
the model class is built on the meta device, materialized on the target device and filled
with N(0, 0.02) (norms 1), which takes well under a second for 16 GB on a GPU. `--dry-run`
uses `TINY`, the same code on a few MB.
"""

from __future__ import annotations

from typing import Any

import torch

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
)  # fmt: skip
# Same GQA group (4) and head dim as Llama-3-8B, so the same attention kernels run.
TINY = dict(
    LLAMA3_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=1, head_dim=128, vocab_size=1024,
)  # fmt: skip


def llama_config(dims: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**dims, bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


@torch.no_grad()
def random_model(dims: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    """Our model class for `dims`, weights drawn on `device` (seeded), eval mode."""
    from engine.worker.models.loader import build_model

    model = build_model(llama_config(dims), dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model.eval().requires_grad_(False)
