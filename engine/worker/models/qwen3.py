"""Qwen3: the Llama decoder plus a per-head RMSNorm on q and k before rotary embedding.

head_dim comes from the config (it need not be hidden_size / num_heads); q/k/v/o biases
follow `attention_bias`. HF names `self_attn.q_norm.weight` / `k_norm.weight` load as-is.
"""

from __future__ import annotations

from engine.worker.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
