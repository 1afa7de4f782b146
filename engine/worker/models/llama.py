"""Llama, Mistral and Qwen2: one decoder, three sets of flags.

The three families differ only in biases and sliding windows, so they share this file;
Qwen3 (per-head q/k RMSNorm) subclasses it in qwen3.py. Parameter names mirror the HF
checkpoint except for the fused projections:

    self_attn.qkv_proj  = rows [q_proj; k_proj; v_proj]
    mlp.gate_up_proj    = rows [gate_proj; up_proj]

Tokens of all requests of a step are flattened into one dimension T; attention goes through
`ctx.backend`, which reads and writes the paged KV cache.

Under tensor parallelism (`tp`, see parallel.py) each rank builds the same modules at its
shard's sizes (its heads, its intermediate features, its vocabulary rows); the only changes
to the forward are the all-reduce after o_proj and after down_proj and the logits gathered
on rank 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.attention.base import AttentionLayerSpec, ForwardContext
from engine.worker.kernels import fused
from engine.worker.models import cpu_fused
from engine.worker.models.cpu_linear import (
    AmxWeight,
    amx_summary,
    pack_linears,
    pack_weight,
    packed_linear,
    packing_available,
    small_rows,
)
from engine.worker.models.greedy_screen import GreedyScreen, build_greedy_screen
from engine.worker.models.layers import FusedLinear, RMSNorm, silu_and_mul
from engine.worker.models.parallel import (
    TensorParallel,
    VocabParallelEmbedding,
    head_shard,
    vocab_rows,
)
from engine.worker.models.rope import RotaryEmbedding, apply_rope
from engine.worker.models.sharding import CheckpointSlice, LlamaShardPlan

# HF projection name -> (fused module name, shard name)
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def head_dim_of(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """The sliding window of each layer (None = full attention).

    transformers 5 configs list `layer_types` (Qwen2/Qwen3 derive it from
    use_sliding_window + max_window_layers); Mistral has one `sliding_window` for all layers.
    """
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if not window:
        return [None] * n
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if getattr(hf_config, "use_sliding_window", True) is False:
        return [None] * n
    max_window_layers = getattr(hf_config, "max_window_layers", None)
    if max_window_layers is not None and hasattr(hf_config, "use_sliding_window"):
        return [window if i >= max_window_layers else None for i in range(n)]
    return [window] * n


class Attention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        spec: AttentionLayerSpec,
        flags: dict[str, bool],
        tp: TensorParallel,
    ):
        """`spec` holds this rank's heads; o_proj takes their features (row-parallel)."""
        super().__init__()
        self.spec = spec
        self.tp = tp
        h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = h * d, hkv * d
        self.qkv_proj = FusedLinear(
            hf_config.hidden_size, {"q": h * d, "k": hkv * d, "v": hkv * d}, bias=flags["qkv_bias"]
        )
        self.o_proj = nn.Linear(h * d, hf_config.hidden_size, bias=flags["o_bias"])
        if flags["qk_norm"]:
            self.q_norm = RMSNorm(d, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(d, hf_config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [T, 1, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, hidden]
        spec = self.spec
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, spec.num_heads, spec.head_dim)  # [T, H, D]
        k = k.view(-1, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, D]
        v = v.view(-1, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.backend.forward(q, k, v, kv_cache, ctx.attn_metadata, spec)  # [T, H, D]
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, hf_config: Any, tp: TensorParallel):
        """This rank's 1/tp.size of the intermediate features (column- then row-parallel)."""
        super().__init__()
        self.tp = tp
        inter = hf_config.intermediate_size // tp.size
        bias = bool(getattr(hf_config, "mlp_bias", False))
        self.gate_up_proj = FusedLinear(
            hf_config.hidden_size, {"gate": inter, "up": inter}, bias=bias
        )
        self.down_proj = nn.Linear(inter, hf_config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        spec: AttentionLayerSpec,
        flags: dict[str, bool],
        tp: TensorParallel,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.self_attn = Attention(hf_config, spec, flags, tp)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.mlp = MLP(hf_config, tp)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(
        self,
        hf_config: Any,
        specs: list[AttentionLayerSpec],
        flags: dict[str, bool],
        tp: TensorParallel,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(hf_config, s, flags, tp) for s in specs)
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(hf_config, specs[0].head_dim)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache; see the module docstring."""

    # Which optional pieces this family has; `None` means "read config.attention_bias".
    qkv_bias: ClassVar[bool | None] = None
    o_bias: ClassVar[bool | None] = None
    qk_norm: ClassVar[bool] = False

    def __init__(self, hf_config: Any, tp: TensorParallel | None = None, *, lm_head: bool = True):
        """`tp`: this rank's place in a tensor-parallel group (default: one device).
        `lm_head` False: the decoder alone, for an embedding model (hidden states are pooled,
        never turned into logits); a checkpoint's LM head weights are then skipped."""
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        self.config = hf_config
        self.tp = tp = tp or TensorParallel()
        self.num_layers = hf_config.num_hidden_layers
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        heads = head_shard(total_heads, total_kv_heads, tp)
        # This rank's heads (all of them at tp.size 1): the attention specs and KV cache.
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = head_dim_of(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        attn_bias = bool(getattr(hf_config, "attention_bias", False))
        flags = {
            "qkv_bias": attn_bias if self.qkv_bias is None else self.qkv_bias,
            "o_bias": attn_bias if self.o_bias is None else self.o_bias,
            "qk_norm": self.qk_norm,
        }
        self.attention_specs = [
            AttentionLayerSpec(
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                scale=self.head_dim**-0.5,
                sliding_window=window,
            )
            for window in layer_sliding_windows(hf_config)
        ]
        self.model = DecoderModel(hf_config, self.attention_specs, flags, tp)
        self.has_lm_head = lm_head
        if self.tie_word_embeddings or not lm_head:
            self.lm_head = None
        else:
            rows = vocab_rows(self.vocab_size, tp)[1]
            self.lm_head = nn.Linear(hf_config.hidden_size, rows, bias=False)
        self._shard_plan = (
            LlamaShardPlan(hf_config, heads, self.head_dim, tp) if tp.size > 1 else None
        )
        self._packed_embedding: torch.Tensor | AmxWeight | None = None  # tied LM head, packed
        self._cpu_fused = False  # forward through models/cpu_fused.py
        # fp32 on a CPU with native bf16: greedy rows' argmax without the fp32 logits.
        self.greedy_screen: GreedyScreen | None = None

    def enable_cpu_kernels(self) -> str:
        """fp32 or bf16 on the CPU: oneDNN-packed linears (models/cpu_linear.py), and the
        fused elementwise kernels (models/cpu_fused.py) when they build. Returns what was
        done."""
        count = pack_linears(self)
        probe = self.model.norm.weight  # in the run dtype whatever the linears' format
        if self.lm_head is None and self.has_lm_head and count and packing_available(probe.dtype):
            self._packed_embedding = pack_weight(self.model.embed_tokens.weight)
            count += 1
        self._cpu_fused = fused.usable(probe)
        if probe.dtype == torch.float32 and self.has_lm_head and self.tp.size == 1:
            owner = self.lm_head if self.lm_head is not None else self.model.embed_tokens
            head = getattr(owner, "weight", None)
            if isinstance(head, torch.Tensor) and head.dtype == torch.float32 and head.dim() == 2:
                self.greedy_screen = build_greedy_screen(head[: self.vocab_size])
        if self._cpu_fused:
            self.model.rotary_emb.tables(probe.dtype)  # converted once, before any capture
        packed = [getattr(m, "packed_weight", None) for m in self.modules()]
        how = amx_summary([*packed, self._packed_embedding])
        return (
            f"{count} {str(probe.dtype).removeprefix('torch.')} linear weights packed{how}, "
            f"fused elementwise kernels {self._cpu_fused}, "
            f"greedy LM-head screen {self.greedy_screen is not None}"
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, hidden]
        if self._cpu_fused:
            return cpu_fused.forward(self, input_ids, positions, ctx)
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos_sin = self.model.rotary_emb(positions, x.dtype)  # each [T, 1, D]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos_sin, ctx.kv_caches[i], ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] float32 (matmul in the model dtype, like HF).

        `keep_dtype`: leave them in the model's dtype (bf16 logits widen to fp32 exactly, so
        a greedy argmax reads them as they are and the sampler widens them only when it
        needs more; without tensor parallelism only, whose gather stays fp32). Under tensor
        parallelism every rank computes its vocabulary columns and rank 0 gets them all;
        the other ranks get None (they must still call this: it is a collective)."""
        if not self.has_lm_head:
            raise RuntimeError("this model was built without an LM head (an embedding model)")
        logits = self.tp.gather_columns(
            self._local_logits(hidden, widen=not keep_dtype or self.tp.size > 1)
        )
        if logits is None or logits.shape[1] == self.vocab_size:
            return logits
        return logits[:, : self.vocab_size].contiguous()  # without the padding columns

    def _local_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """[N, this rank's vocab], fp32 when `widen`."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            emb = self.model.embed_tokens.weight
            if self._packed_embedding is not None and hidden.shape[0] >= small_rows(hidden.dtype):
                logits = packed_linear(hidden, self._packed_embedding, None, emb.shape[0])
            else:
                logits = F.linear(hidden, emb)
        return logits.float() if widen else logits

    def checkpoint_slice(self, name: str) -> CheckpointSlice | None:
        """The part of checkpoint tensor `name` this rank loads (None: all of it)."""
        return None if self._shard_plan is None else self._shard_plan.slice_for(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our parameters, fusing q/k/v and gate/up.

        Raises ValueError for unknown names and for parameters left unloaded, so a
        mismatched checkpoint fails loudly instead of running on random weights.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb." in name:
                continue  # recomputed, never loaded
            if name == "lm_head.weight" and self.lm_head is None:
                if not self.tie_word_embeddings:
                    continue  # built without an LM head: an embedding model never uses it
                name = "model.embed_tokens.weight"  # tied: some checkpoints store only this
                if "model.embed_tokens.weight" in loaded:
                    continue
            parts = name.split(".")
            own = self._self_loading(parts)
            if own is not None:  # a layer that loads its own format (engine/worker/quant)
                module, shard = own
                module.load_tensor(parts[-1], shard, tensor)
                continue
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
                if target not in params:
                    raise ValueError(f"unexpected checkpoint tensor {name!r}")
                module = self.get_submodule(".".join([*parts[:-2], fused]))
                module.load_shard(params[target], shard, tensor.to(params[target].dtype))
                loaded.add(f"{target}:{shard}")
                continue
            if name not in params:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(name)
        missing = [n for n in self._expected_loads(params) if n not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")

    def _self_loading(self, parts: list[str]) -> tuple[nn.Module, str | None] | None:
        """(layer, shard) when checkpoint tensor `parts` belongs to a layer with its own
        `load_tensor` (a quantized linear or embedding: it checks its shards itself when
        finalized); None for parameters copied here."""
        path, shard = parts[:-1], None
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            path = [*parts[:-2], fused]
        try:
            module = self.get_submodule(".".join(path))
        except AttributeError:
            return None
        return (module, shard) if hasattr(module, "load_tensor") else None

    def _expected_loads(self, params: dict[str, torch.Tensor]) -> list[str]:
        expected = []
        for name in params:
            module_name, _, _ = name.rpartition(".")
            module = self.get_submodule(module_name)
            if hasattr(module, "load_tensor"):
                continue  # checked by the layer's own finalize
            if isinstance(module, FusedLinear):
                expected += [f"{name}:{shard}" for shard in module.shard_offsets]
            else:
                expected.append(name)
        return expected


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama without biases; `sliding_window` (when set) applies to every layer."""

    qkv_bias = False
    o_bias = False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: bias on q/k/v only; optional sliding window on layers >= max_window_layers."""

    qkv_bias = True
    o_bias = False
