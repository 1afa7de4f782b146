"""`LoRALinear`: a model's linear layer plus the batched LoRA product of the step's adapters.

The wrapper keeps the base layer untouched (a plain `nn.Linear`, a `FusedLinear`, a oneDNN
packed linear: whatever its `forward` is) and adds, after the base product, the LoRA delta
of the rows whose request runs an adapter. Each wrapper holds its adapters' weights stacked
per device slot, with one column block per fused slice::

    lora_a  [max_loras, in,  n_slices * R]   slice j's A^T in columns j*R : j*R + r
    lora_b  [max_loras, n_slices * R, out]   slice j's (scale * B)^T in rows j*R : j*R + r,
                                             columns of slice j's output (block diagonal)

so q/k/v land in their parts of qkv_proj's output and gate/up in theirs, with one shrink
and one expand product per slot, and a rank below R leaves zero columns. The step's rows
come ordered by slot (`LoRABatch`, built once per step in `batch.py`): each slot's rows are
one range, multiplied by that slot's weights and added in place; equal ranges over
consecutive slots go through one `torch.bmm` over the slots.

On the CPU the LoRA weights and products are float32 whatever the model's dtype: a bf16
`bmm` of these small shapes ran ~3x slower than fp32 here (it has no packed fast path),
and the delta is small next to the base product, so converting x's rows is cheaper. On
CUDA they are in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.worker.lora.batch import LoRABatch
from engine.worker.lora.peft_adapter import SUPPORTED_MODULES, LoRAShapes, ProjectionShape

# Our module path inside a decoder layer -> its HF projections, in output-row order.
WRAPPED = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


@dataclass
class LoRAStep:
    """The one per-step value every wrapper reads: the runner sets it before the forward
    (None when no row of the step runs an adapter)."""

    batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """`base(x)` plus the LoRA delta of the step's adapter rows; see the module docstring."""

    def __init__(
        self,
        base: nn.Module,
        layer: int,
        slices: tuple[str, ...],
        max_loras: int,
        max_rank: int,
        step: LoRAStep,
    ):
        super().__init__()
        self.base = base
        self.layer = layer
        self.slices = slices
        self.rank = max_rank
        self.step = step
        # in/out features and a tensor of the layer: a float weight or a quantized layer's
        # bytes (the LoRA product stays float beside a quantized base).
        w = next(t for t in (*base.parameters(), *base.buffers()) if t.numel())
        out_features, in_features = base.out_features, base.in_features
        dtype = torch.float32 if w.device.type == "cpu" else _float_dtype(base, w)
        sizes = _slice_sizes(base, slices, out_features)
        self.offsets = dict(zip(slices, _cumulative(sizes), strict=True))
        self.sizes = dict(zip(slices, sizes, strict=True))
        n = len(slices) * max_rank
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, in_features, n, dtype=dtype, device=w.device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, n, out_features, dtype=dtype, device=w.device)
        )
        # Which slots hold a non-zero delta for this layer: steps whose slots all hold none
        # skip the LoRA product here (an adapter that targets only q and v, say).
        self.filled = [False] * max_loras

    def load_slot(self, slot: int, modules: dict[tuple[int, str], tuple[torch.Tensor, ...]]):
        """Writes one adapter's pieces for this layer into `slot` (zeros where it has none)."""
        a_all, b_all = self.lora_a[slot], self.lora_b[slot]
        a_all.zero_()
        b_all.zero_()
        filled = False
        for j, proj in enumerate(self.slices):
            piece = modules.get((self.layer, proj))
            if piece is None:
                continue
            a, b = piece  # [r, in], [out_j, r]
            r, col, off = a.shape[0], j * self.rank, self.offsets[proj]
            a_all[:, col : col + r].copy_(a.t(), non_blocking=True)
            b_all[col : col + r, off : off + self.sizes[proj]].copy_(b.t(), non_blocking=True)
            filled = True
        self.filled[slot] = filled

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = self.base(x)
        batch = self.step.batch
        if batch is None or not any(self.filled[s] for s in batch.slots):
            return y
        a, b = self.lora_a, self.lora_b
        same = y.dtype == a.dtype  # then the expand product accumulates into y directly
        if batch.uniform is not None:  # equal segments over consecutive slots: one bmm
            lo, hi, rows = batch.uniform
            n = (hi - lo) * rows
            u = torch.bmm(x[:n].to(a.dtype).reshape(hi - lo, rows, -1), a[lo:hi])
            ys = y[:n].view(hi - lo, rows, -1)
            if same:
                ys.baddbmm_(u, b[lo:hi])
            else:
                ys.add_(torch.bmm(u, b[lo:hi]))
            return y
        for slot, start, stop in batch.segments:
            u, ys = x[start:stop].to(a.dtype) @ a[slot], y[start:stop]
            if same:
                ys.addmm_(u, b[slot])
            else:
                ys.add_(u @ b[slot])
        return y


def _slice_sizes(base: nn.Module, slices: tuple[str, ...], out_features: int) -> list[int]:
    """Output rows per HF projection: a FusedLinear's shards (named "q", "gate", ...), or
    the whole output for a plain linear."""
    offsets = getattr(base, "shard_offsets", None)
    if offsets is None:
        return [out_features]
    return [offsets[p.removesuffix("_proj")][1] for p in slices]


def _float_dtype(base: nn.Module, w: torch.Tensor) -> torch.dtype:
    """The base layer's compute dtype: its weight's, or a quantized layer's activations'."""
    return w.dtype if w.is_floating_point() else getattr(base, "act_dtype", torch.float32)


def _cumulative(sizes: list[int]) -> list[int]:
    out, start = [], 0
    for s in sizes:
        out.append(start)
        start += s
    return out


def _layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def lora_shapes(model: nn.Module) -> LoRAShapes:
    """The projections of the model's first layer, as adapters must fit them."""
    layers = _layers(model)
    first = layers[0]
    shapes = {}
    for path, projs in WRAPPED.items():
        base = first.get_submodule(path)
        out_features, in_features = base.out_features, base.in_features
        for proj, size in zip(projs, _slice_sizes(base, projs, out_features), strict=True):
            shapes[proj] = ProjectionShape(in_features, size)
    assert set(shapes) == set(SUPPORTED_MODULES)
    return LoRAShapes(len(layers), shapes)


def wrap_linears(
    model: nn.Module, max_loras: int, max_rank: int, step: LoRAStep
) -> list[LoRALinear]:
    """Replaces every targetable linear of every layer by a `LoRALinear` around it (the
    module attribute is swapped; the base module and its weights stay as they were)."""
    wrappers = []
    for i, layer in enumerate(_layers(model)):
        for path, projs in WRAPPED.items():
            parent_path, _, attr = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            wrapper = LoRALinear(getattr(parent, attr), i, projs, max_loras, max_rank, step)
            setattr(parent, attr, wrapper)
            wrappers.append(wrapper)
    return wrappers
