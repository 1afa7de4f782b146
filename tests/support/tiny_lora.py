"""Tiny random PEFT LoRA adapters for the tiny checkpoints, and PEFT's greedy reference.

`make_tiny_adapter` builds the adapter with PEFT itself (`get_peft_model` on the
transformers model, then `save_pretrained`), so the files are exactly what PEFT writes;
A and B are drawn from a seeded normal distribution (PEFT initialises B to zero, which
would change nothing). `peft_greedy` is the reference: the unmerged `PeftModel` over the
transformers base model, greedy, token for token.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from tests.support.tiny_models import model_greedy

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_tiny_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    targets: Any = ALL_TARGETS,
    r: int = 8,
    alpha: float = 16,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.1,
    **config: Any,
) -> Path:
    """Saves a PEFT LoRA adapter for the checkpoint at `base_dir`; returns `out_dir`.
    `targets` is PEFT's target_modules (a list, a regex string or "all-linear"); `config`
    takes any other LoraConfig field (rank_pattern, alpha_pattern, ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    lora_config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets) if isinstance(targets, tuple) else targets,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        **config,
    )
    model = get_peft_model(base, lora_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


@functools.lru_cache(maxsize=8)
def _peft_model(base_dir: str, adapter_dir: str) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(
    base_dir: str | Path, adapter_dir: str | Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy tokens of the base model with the adapter (unmerged PeftModel, fp32), EOS
    ignored."""
    model = _peft_model(str(Path(base_dir).resolve()), str(Path(adapter_dir).resolve()))
    return model_greedy(model, prompts, max_new_tokens, eos=set())
