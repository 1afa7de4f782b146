"""A small step's decoder layers in one C call (csrc/decoder_stack.c), for cpu_fused.py.

The per-op CPU forward (cpu_fused.py) calls ~10 C kernels per layer, each with its Python,
its allocations and an OpenMP fork and join; at one row on a 135M model that overhead was
as large as the weights' reads. `CpuStack` hands the whole stack of layers to one C call
that runs the same kernel bodies in one parallel region, so its result is bitwise the
per-op path's (tests/worker/test_cpu_stack.py compares them), and returns the residual
stream and the last MLP output for the final norm.

It applies where the per-op path would run exactly these kernels, and the caller falls
back otherwise (`run` returns None):

- the model (checked once, on the first forward, after LoRA has wrapped what it wraps):
  one tensor-parallel rank, no q/k norm, every q/k/v, o, gate/up and down projection a
  plain `QuantLinear` of q4 column groups, q4 or q8 blocks with the kernel library and
  float activations (not int8), or a plain bf16 linear packed for the AMX kernel
  (models/cpu_linear.py's `AmxWeight`); activations fp32 or bf16;
- the step: fewer rows than `dense_rows` (the block kernels' side of the row rule) and at
  most `AMX_MAX_ROWS` where AMX linears are in the stack (theirs), the
  torch paged backend attending every row with its native kernel (decode rows, short
  verify chunks; no prefill chunk, no padding), a KV cache in the activations' dtype the
  kernel supports.

`APPLIANCE_CPU_STACK=off` turns it off (benchmarks compare both paths).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import torch
from torch import nn

from engine.worker.kernels import attention as native
from engine.worker.kernels import stack as kstack
from engine.worker.models.cpu_linear import AMX_MAX_ROWS, AmxWeight
from engine.worker.models.layers import FusedLinear
from engine.worker.quant.blocks import Q4, Q4G, Q8
from engine.worker.quant.linear import QuantLinear, dense_rows

logger = logging.getLogger(__name__)

_KINDS = (Q4, Q4G, Q8)


def disabled_by_env() -> bool:
    return os.environ.get("APPLIANCE_CPU_STACK", "on").lower() in ("0", "off", "false", "no")


def _linears(layer) -> list[Any]:
    a, m = layer.self_attn, layer.mlp
    return [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]


def _amx(lin) -> bool:
    """A plain (not LoRA-wrapped) bf16 linear whose weight is packed for the AMX kernel."""
    return type(lin) in (nn.Linear, FusedLinear) and isinstance(
        getattr(lin, "packed_weight", None), AmxWeight
    )


def unsupported(model) -> str | None:
    """Why `model` cannot run as one stack (None: it can)."""
    if disabled_by_env():
        return "APPLIANCE_CPU_STACK is off"
    if model.tp.size != 1:
        return "tensor parallelism"
    if model.qk_norm:
        return "per-head q/k norms"
    dtype = model.model.norm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"activations in {dtype}"
    for layer in model.model.layers:
        for lin in _linears(layer):
            if _amx(lin):  # bf16 tiles: the activations are bf16 too
                continue
            if type(lin) is not QuantLinear:  # LoRA wrappers, fp8, other float linears
                return f"a {type(lin).__name__} projection"
            if lin.kind not in _KINDS or not lin._bound or lin.int8_activations:
                return "a projection outside the block kernels"
    for spec in model.attention_specs:
        if spec.logits_soft_cap is not None:
            return "attention logit soft-capping"
    return None


class CpuStack:
    """The structs of one model (weights' pointers bound once) and the per-step call."""

    def __init__(self, model) -> None:
        m = model.model
        self.dtype = m.norm.weight.dtype
        spec = model.attention_specs[0]
        cos, sin = m.rotary_emb.tables(self.dtype)
        layers = (kstack.StackLayer * len(m.layers))()
        keep: list[torch.Tensor] = [cos, sin]  # pointers below stay valid while these live
        amx = quant = False
        for i, layer in enumerate(m.layers):
            s = layers[i]
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            w1, w2 = ln1.weight.detach().contiguous(), ln2.weight.detach().contiguous()
            keep += [w1, w2]
            s.ln1, s.ln2, s.eps1, s.eps2 = w1.data_ptr(), w2.data_ptr(), ln1.eps, ln2.eps
            for j, lin in enumerate(_linears(layer)):
                if isinstance(lin, QuantLinear):
                    s.w[j], s.kind[j] = lin.qdata.data_ptr(), lin.kind
                    keep.append(lin.qdata)
                    quant = True
                else:  # AMX tiles (`_amx`); the bias, if any, in the weight's bf16
                    s.w[j], s.kind[j] = lin.packed_weight.tiles.data_ptr(), kstack.AMX_BF16_KIND
                    keep.append(lin.packed_weight.tiles)
                    amx = True
                s.bias[j] = lin.bias.data_ptr() if lin.bias is not None else None
            s.window = int(model.attention_specs[i].sliding_window or 0)
        self._keep = keep
        self.layers = layers
        # The most rows a step may have: the block kernels' side of their rule, AMX's limit.
        limits = ([dense_rows(self.dtype) - 1] if quant else []) + ([AMX_MAX_ROWS] if amx else [])
        self.max_rows = min(limits)
        self.model = kstack.StackModel(
            n_layers=len(m.layers), hidden=m.norm.weight.shape[0], heads=spec.num_heads,
            kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            inter=m.layers[0].mlp.down_proj.in_features, block_size=0,
            bf16=int(self.dtype == torch.bfloat16), scale=spec.scale,
            cos=cos.data_ptr(), sin=sin.data_ptr(),
            layers=ctypes.cast(layers, ctypes.POINTER(kstack.StackLayer)),
        )  # fmt: skip
        self._caches: tuple[int, ...] = ()
        self._work = torch.empty(0, dtype=torch.uint8)

    def _bind_caches(self, caches: list[torch.Tensor]) -> bool:
        """Points the layers at this step's KV caches; False when the kernel cannot use them."""
        ptrs = tuple(c.data_ptr() for c in caches)
        if ptrs == self._caches:
            return True
        spec_heads = (self.model.heads, self.model.kv_heads)
        probe = torch.empty(0, dtype=self.dtype)
        for c in caches:
            if c.dtype != self.dtype or not native.supports(probe, c, *spec_heads):
                return False
        for i, ptr in enumerate(ptrs):
            self.layers[i].kv_cache = ptr
        self.model.block_size = caches[0].shape[2]
        self._caches = ptrs
        return True

    def run(self, h: torch.Tensor, positions: torch.Tensor, ctx) -> tuple | None:
        """h [T, hidden] the embeddings (a new tensor: it becomes the residual stream) ->
        (last MLP output, residual), or None when this step is not the stack's."""
        T = h.shape[0]
        md = ctx.attn_metadata
        items_of = getattr(ctx.backend, "native_items", None)
        if not 0 < T <= self.max_rows or items_of is None or md.num_tokens != T:
            return None
        if h.dtype != self.dtype or not h.is_contiguous() or not self._bind_caches(ctx.kv_caches):
            return None
        items = items_of(md)
        if items is None or items[0].numel() != T:
            return None
        rows, reqs, pos = items
        tables = md.block_tables
        if tables.dtype != torch.int32 or tables.stride(1) != 1:
            tables = tables.int().contiguous()
        slots = md.slot_mapping[:T]
        if slots.dtype != torch.long or not slots.is_contiguous():
            slots = slots.long().contiguous()
        need = kstack.workspace_bytes(self.model, T) + 64
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.uint8)
        work = (self._work.data_ptr() + 63) // 64 * 64
        out = torch.empty_like(h)
        step = kstack.StackStep(
            T=T, res=h.data_ptr(), out=out.data_ptr(), positions=positions.data_ptr(),
            slots=slots.data_ptr(), block_tables=tables.data_ptr(), bt_stride=tables.stride(0),
            q_rows=rows.data_ptr(), reqs=reqs.data_ptr(), pos=pos.data_ptr(),
            n_items=rows.numel(), work=work,
        )  # fmt: skip
        if kstack.run(self.model, step, torch.get_num_threads()) != 0:
            raise RuntimeError("decoder_stack refused a step it was given")
        return out, h


def build(model) -> CpuStack | None:
    """The model's stack, or None (the reason logged once)."""
    why = unsupported(model)
    if why is not None:
        logger.info("CPU decoder stack off: %s; layers run op by op", why)
        return None
    logger.info("CPU decoder stack on: small steps run every layer in one C call")
    return CpuStack(model)
