"""Pre-quantized HF checkpoints: what a format reader hands the loader, and the grouping
of a module's packed tensors into the one weight its layer takes.

    Prequantized                   a validated quantization_config (compressed_tensors.py
                                   reads one; plan.py picks the reader by quant_method)
    group_quantized(weights, names, source)
                                   (HF name, tensor) pairs in, the same pairs out except that
                                   a quantized module's tensors (weight_packed, weight_scale,
                                   ... or qweight, qzeros, scales) leave as one
                                   `<module>.weight` in the layer's format

A module's tensors may sit in different shards, so the set of tensors each module carries
is read from the checkpoint's names up front (`names`: safetensors headers), and a module
is converted as soon as all of them have arrived; it holds nothing else in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine.config import ConfigError
from engine.worker.quant.blocks import BlockTensor
from engine.worker.quant.fp8_rows import Fp8Rows

Converted = BlockTensor | Fp8Rows


@dataclass(frozen=True)
class Prequantized:
    """A checkpoint's quantization, validated: how to find and convert its modules."""

    method: str  # quant_method: "compressed-tensors", "awq", "gptq"
    summary: str  # the start-up log's words for it
    fp8: bool  # every quantized module is fp8 e4m3 (Fp8Linear on GPUs that have fp8)
    # module name -> the tensor leaves it carries (from every name in the checkpoint)
    quantized_modules: Callable[[set[str]], dict[str, frozenset[str]]]
    # (module name, {leaf: tensor}) -> the weight the layer keeps; ConfigError if unloadable
    convert: Callable[[str, dict[str, torch.Tensor]], Converted]


def group_quantized(
    weights: Iterator[tuple[str, torch.Tensor]], names: set[str], source: Prequantized
) -> Iterator[tuple[str, torch.Tensor | Converted]]:
    """See the module docstring. A checkpoint without any quantized module, or a module
    whose tensors never all arrive, is a ConfigError naming what is missing."""
    modules = source.quantized_modules(names)
    if not modules:
        raise ConfigError(
            "model.path",
            f"the config says {source.summary}, but no tensor in the checkpoint is quantized "
            "(no weight_scale / qweight): refused rather than read as float weights",
        )
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        leaves = modules.get(module)
        if leaves is None or leaf not in leaves:
            yield name, tensor
            continue
        got = pending.setdefault(module, {})
        got[leaf] = tensor
        if len(got) == len(leaves):
            del pending[module]
            yield f"{module}.weight", source.convert(module, got)
    for module, got in pending.items():
        missing = ", ".join(sorted(modules[module] - got.keys()))
        raise ConfigError("model.path", f"{source.method} tensors of {module}: {missing} not read")


def modules_marked(
    names: set[str], marker: str, leaves: frozenset[str]
) -> dict[str, frozenset[str]]:
    """Module name -> its tensor leaves among `leaves`, for every module that carries a
    `marker` leaf (a format's sign that the module is quantized)."""
    modules = {n.rpartition(".")[0] for n in names if n.endswith("." + marker)}
    out: dict[str, set[str]] = {m: set() for m in modules}
    for n in names:
        module, _, leaf = n.rpartition(".")
        if module in out and leaf in leaves:
            out[module].add(leaf)
    return {m: frozenset(found) for m, found in out.items()}
