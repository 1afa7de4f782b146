"""A GGUF file's weights for `load_weights`: HF names, this rank's slices, the plan's format.

    gguf_has_quantized(index)                        any quantized 2-D tensor in the file?
    iter_gguf_weights(path, index, cfg, dev, sel, plan)  (HF name, tensor or BlockTensor)

With `model.quantization: auto` the tensors come in their block formats
(engine/worker/quant/gguf_tensors.py); otherwise (`none`, and `int8` / `int4`, which then
quantize these float values at load) every quantized tensor is dequantized by the `gguf`
package's own `gguf.quants.dequantize`, so the float path runs on exactly the values
transformers reads from the file. A tensor type we cannot map is a
`ConfigError` on `model.path` naming the tensor and its type; a tensor-parallel slice that
cuts through a block is one on `parallel.tensor_parallel_size`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError
from engine.worker.models.sharding import CheckpointSlice, slice_loaded
from engine.worker.quant.blocks import BlockTensor
from engine.worker.quant.gguf_tensors import UnsupportedGGUFTensor, read_gguf_tensors
from engine.worker.quant.plan import QuantPlan


def gguf_has_quantized(index: dict[str, Any]) -> bool:
    floats = ("F32", "F16", "BF16")
    return any(len(t["shape"]) == 2 and t["type"] not in floats for t in index["tensors"])


def iter_gguf_weights(
    path: Path,
    index: dict[str, Any],
    hf_config: Any,
    device: torch.device,
    select: Callable[[str], CheckpointSlice | None] | None,
    plan: QuantPlan,
) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
    try:
        keep = plan.method == "gguf"  # int8 / int4 re-quantize the file's float values
        for name, tensor, _ in read_gguf_tensors(path, index, hf_config, keep):
            part = select(name) if select is not None else None
            if part is not None:
                tensor = slice_loaded(tensor, part, name)
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to(device)
            yield name, tensor
    except UnsupportedGGUFTensor as e:
        raise ConfigError("model.path", f"{path.name}: {e}") from None
