"""Swap a model's linears for `QuantLinear`s before its weights load, and finish them after.

    install(model, plan, dtype)   on the meta-device model, before `to_empty`: every linear
                                  (fused or not) becomes a QuantLinear of the same shape;
                                  a tied embedding becomes a QuantEmbedding
    finalize_model(model)         after `load_weights`: each layer joins its shards and picks
                                  its format; the tied LM head becomes the embedding's own
                                  QuantLinear (the same bytes); returns a summary for the log

The model file never learns which format a layer holds: it calls the layer.
"""

from __future__ import annotations

import collections

import torch
from torch import nn

from engine.worker.quant.fp8 import Fp8Linear
from engine.worker.quant.linear import DenseScratch, QuantEmbedding, QuantLinear
from engine.worker.quant.plan import QuantPlan


def install(model: nn.Module, plan: QuantPlan, dtype: torch.dtype) -> None:
    scratch = DenseScratch()
    replace: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        head = name == "lm_head"
        offsets = getattr(module, "shard_offsets", None)
        sizes = {s: n for s, (_, n) in offsets.items()} if offsets else None
        cls = Fp8Linear if plan.method == "fp8" and not head else QuantLinear
        replace.append((name, cls(
            module.in_features, module.out_features, module.bias is not None,
            shard_sizes=sizes, target=plan.head if head else plan.layers, group=plan.group,
            scratch=scratch, dtype=dtype,
        )))  # fmt: skip
        if cls is QuantLinear:
            replace[-1][1].int8_activations = plan.int8_activations
        else:  # a pre-quantized checkpoint's float layers are those it left float
            replace[-1][1].quantize_float = plan.source is None
    emb = model.model.embed_tokens
    qe = QuantEmbedding(emb.num_embeddings, emb.embedding_dim, emb.tp, emb.vocab_start, dtype)
    # Tied, the embedding is the LM head too and is quantized like one; untied it is only
    # looked up (a GGUF's blocks stay blocks, float stays float).
    qe.linear.target = plan.head if getattr(model, "lm_head", None) is None else None
    qe.linear.scratch = scratch
    qe.linear.int8_activations = plan.int8_activations
    replace.append(("model.embed_tokens", qe))
    for name, new in replace:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def finalize_model(model: nn.Module) -> str:
    """Finishes every quantized layer; returns 'N layers q4 blocks, ...' with weight bytes."""
    formats: collections.Counter[str] = collections.Counter()
    total = 0
    for module in list(model.modules()):
        if isinstance(module, QuantLinear | QuantEmbedding):
            if isinstance(module, QuantLinear) and module.finalized:
                continue  # already finished (the embedding's linear)
            formats[module.finalize()] += 1
    emb = model.model.embed_tokens
    if isinstance(emb, QuantEmbedding) and getattr(model, "lm_head", None) is None:
        model.lm_head = emb.linear  # the tied head: same module, same bytes
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantLinear) and id(module) not in seen:
            seen.add(id(module))
            total += module.weight_bytes()
    parts = ", ".join(f"{n} x {fmt}" for fmt, n in sorted(formats.items()))
    return f"{parts}; {total / 2**20:.1f} MiB of linear and embedding weights"
