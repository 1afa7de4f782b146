"""The Llama-family forward on the CPU with fused elementwise kernels (engine/worker/kernels/).

Same math as `LlamaForCausalLM.forward` and its layers, restructured the way fused kernels
want it: the residual stream is carried separately and updated in place by the RMSNorm that
follows each sublayer (`x + sublayer(norm(x))` becomes `residual += out; norm(residual)`),
rotary embedding rotates q and k inside the fused qkv output in place, and SiLU-and-mul is
one pass. Linear layers and attention are the model's own modules (each rank's shards under
tensor parallelism, with the same all-reduces as the plain forward). Used for fp32 and bf16 on
the CPU with the kernel library loaded (`LlamaForCausalLM.enable_cpu_kernels`); in bf16 the
residual stream and every activation stay bf16 between ops, as in transformers. Small
steps on block-quantized layers run all layers in one C call instead (cpu_stack.py), with
the same kernels and so the same values.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.worker.attention.base import ForwardContext
from engine.worker.kernels import fused
from engine.worker.models import cpu_stack
from engine.worker.models.rope import apply_rope


def forward(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
    """[T] ids and positions -> final hidden states [T, hidden] (after the last norm)."""
    m = model.model
    rot = m.rotary_emb
    if positions.numel() and int(positions.max()) >= rot.cos_cache.shape[0]:
        raise ValueError(f"position {int(positions.max())} beyond the rotary table")
    positions = positions.long().contiguous()
    h = m.embed_tokens(input_ids)  # a new tensor: safe to use as the residual stream
    stack = _stack_of(model)
    done = stack.run(h, positions, ctx) if stack is not None else None
    if done is not None:  # every layer in one C call (cpu_stack.py): the same values
        out, residual = done
        return fused.add_rms_norm(out, residual, m.norm.weight, m.norm.eps)
    residual = None
    for i, layer in enumerate(m.layers):
        h, residual = _layer(layer, h, residual, positions, rot, ctx.kv_caches[i], ctx)
    return fused.add_rms_norm(h, residual, m.norm.weight, m.norm.eps)


def _stack_of(model: Any) -> cpu_stack.CpuStack | None:
    """The model's one-call stack, built on the first forward (after LoRA has wrapped its
    layers, so a wrapped model is seen as one), or None where it does not apply."""
    if not getattr(model, "_cpu_stack_checked", False):
        model._cpu_stack = cpu_stack.build(model)
        model._cpu_stack_checked = True
    return model._cpu_stack


def _layer(layer, h, residual, positions, rot, kv_cache, ctx):
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    if residual is None:
        residual = h
        x = fused.add_rms_norm(h, None, ln1.weight, ln1.eps)
    else:
        x = fused.add_rms_norm(h, residual, ln1.weight, ln1.eps)
    a = _attention(layer.self_attn, x, positions, rot, kv_cache, ctx)
    x = fused.add_rms_norm(a, residual, ln2.weight, ln2.eps)
    mlp = layer.mlp
    return mlp.tp.all_reduce(mlp.down_proj(fused.silu_and_mul(mlp.gate_up_proj(x)))), residual


def _attention(attn, x, positions, rot, kv_cache, ctx):
    spec = attn.spec
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    qkv = attn.qkv_proj(x)  # [T, (H + 2 Hkv) D]
    qs, kvs = attn.q_size, attn.kv_size
    if attn.q_norm is None:
        cos, sin = rot.tables(qkv.dtype)
        fused.rope_inplace(qkv[:, : qs + kvs], H + Hkv, D, positions, cos, sin)
        q, k, v = qkv.split([qs, kvs, kvs], dim=-1)
        q, k = q.view(-1, H, D), k.view(-1, Hkv, D)
    else:  # per-head q/k norms come before the rotation: the plain torch ops
        q, k, v = qkv.split([qs, kvs, kvs], dim=-1)
        q, k = attn.q_norm(q.view(-1, H, D)), attn.k_norm(k.view(-1, Hkv, D))
        cos, sin = rot(positions, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = ctx.backend.forward(q, k, v.view(-1, Hkv, D), kv_cache, ctx.attn_metadata, spec)
    return attn.tp.all_reduce(attn.o_proj(out.reshape(-1, qs)))
