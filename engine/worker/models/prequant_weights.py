"""A pre-quantized HF checkpoint's weights for `load_weights`: its packed modules converted
to the layers' formats, this rank's slices, the plan's device.

    checkpoint_names(files)                         every tensor name (safetensors headers)
    iter_prequantized_weights(raw, names, dev, sel, plan)
                                                    (HF name, tensor / BlockTensor / Fp8Rows)

`raw` reads every tensor whole on the CPU (packed layouts do not slice like float ones):
engine/worker/quant/prequantized.py joins each module's tensors into one `.weight` and its
format's reader converts it (compressed_tensors.py); then `slice_loaded` takes this rank's
part. Under `model.quantization: none` (`plan.blocks` False) the converted weights are
dequantized here to float32, which the model casts to its dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine.worker.models.sharding import CheckpointSlice, slice_loaded
from engine.worker.quant.blocks import BlockTensor, dequantize
from engine.worker.quant.fp8_rows import Fp8Rows
from engine.worker.quant.plan import QuantPlan
from engine.worker.quant.prequantized import group_quantized


def checkpoint_names(files: list[Path]) -> set[str]:
    """Every tensor name in the shards (headers only: nothing is read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            names.update(sf.keys())
    return names


def iter_prequantized_weights(
    raw: Iterator[tuple[str, torch.Tensor]],
    names: set[str],
    device: torch.device,
    select: Callable[[str], CheckpointSlice | None] | None,
    plan: QuantPlan,
) -> Iterator[tuple[str, torch.Tensor | BlockTensor | Fp8Rows]]:
    assert plan.source is not None
    for name, tensor in group_quantized(raw, names, plan.source):
        if not plan.blocks and isinstance(tensor, BlockTensor):
            tensor = dequantize(tensor)
        elif not plan.blocks and isinstance(tensor, Fp8Rows):
            tensor = tensor.dequantize()
        part = select(name) if select is not None else None
        if part is not None:
            tensor = slice_loaded(tensor, part, name)
        if not isinstance(tensor, BlockTensor):  # blocks stay on the CPU (QuantLinear moves)
            tensor = tensor.to(device)
        yield name, tensor
