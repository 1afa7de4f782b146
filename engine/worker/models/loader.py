"""Find a checkpoint, build our model class for it and fill it from safetensors.

    resolve_model_path(path)      ->  HF-format directory (config.json, *.safetensors, tokenizer)
    load_model(config, dev, tp)   ->  LoadedModel (model on `dev`, eval mode, no grads)

Accepted paths: a local HF directory, a `.gguf` file, a directory holding exactly one `.gguf`
(both converted once, see gguf_loader.py), a hub id already in the local HF cache (never
downloaded), or None for the default model. The model is built on the meta device and
materialized directly on the target device, so no time goes into random initialization.
Under tensor parallelism (`tp`) each rank builds its shard of the model and reads only its
slices of the checkpoint (`model.checkpoint_slice`, see sharding.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import ConfigError, ModelConfig
from engine.worker.cpu_features import Bf16Support, native_bf16
from engine.worker.models.default_model import default_model_gguf
from engine.worker.models.gguf_loader import convert_gguf, gguf_index
from engine.worker.models.gguf_weights import gguf_has_quantized, iter_gguf_weights
from engine.worker.models.parallel import TensorParallel
from engine.worker.models.prequant_weights import checkpoint_names, iter_prequantized_weights
from engine.worker.models.registry import resolve_architecture
from engine.worker.models.rope import RotaryEmbedding
from engine.worker.models.sharding import CheckpointSlice
from engine.worker.pooling.spec import PoolingSpec, read_pooling_spec, resolve_task
from engine.worker.quant.install import finalize_model, install
from engine.worker.quant.plan import QuantPlan, resolve_plan

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: Any  # transformers PretrainedConfig
    model_dir: Path  # directory holding config.json and the tokenizer files
    dtype: torch.dtype
    generation_config: dict[str, Any] = field(default_factory=dict)
    # generate, or embed (no LM head; `pooling` says how its hidden states become a vector).
    task: str = "generate"
    pooling: PoolingSpec | None = None


def find_model_source(path: str | None, hf_cache_dir: str | Path | None = None) -> Path:
    """The checkpoint a path names without converting it: an HF directory or a .gguf file."""
    if path is None:
        return default_model_gguf()
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"model path {path!r} is a file but not a .gguf")
        return p
    if p.is_dir():
        return _source_in_dir(p, path)
    snapshot = _local_hub_snapshot(path, hf_cache_dir)
    if snapshot is None:
        raise FileNotFoundError(
            f"model path {path!r} is not a local directory or .gguf file, nor a model in the "
            "local Hugging Face cache (models are never downloaded; fetch it beforehand)"
        )
    return _source_in_dir(snapshot, path)


def resolve_model_path(path: str | None, hf_cache_dir: str | Path | None = None) -> Path:
    """A local HF-format directory for `path` (GGUF converted once and cached)."""
    source = find_model_source(path, hf_cache_dir)
    return convert_gguf(source) if source.suffix == ".gguf" else source


def _source_in_dir(d: Path, original: str) -> Path:
    if (d / "config.json").is_file():
        return d
    ggufs = sorted(d.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ValueError(f"model path {original!r} holds several .gguf files ({names}); name one")
    raise FileNotFoundError(f"model path {original!r} has neither config.json nor a .gguf file")


def _local_hub_snapshot(repo_id: str, cache_dir: str | Path | None) -> Path | None:
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except Exception:  # not cached, invalid id, offline errors: all mean "not available"
        return None


@dataclass(frozen=True)
class DtypeChoice:
    """The run dtype and why; `str()` is the start-up log line."""

    dtype: torch.dtype
    why: str  # "checkpoint bfloat16, CPU has AMX-BF16", "model.dtype float32", ...

    def __str__(self) -> str:
        return f"dtype {_name(self.dtype)} ({self.why})"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checkpoint_dtype(hf_config: Any) -> str | None:
    """The dtype name the checkpoint records (`dtype` / `torch_dtype`), None when none."""
    recorded = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return None if recorded is None else str(recorded).removeprefix("torch.")


def resolve_dtype(
    requested: str,
    hf_config: Any,
    device: torch.device,
    bf16: Callable[[], Bf16Support] = native_bf16,
    quantized: bool = False,
) -> DtypeChoice:
    """The run dtype for `model.dtype` = `requested`.

    Explicit float32 / bfloat16 / float16 are kept on every device. `auto`:

        CUDA   the checkpoint's dtype (float32 when it records none or one we do not run)
        CPU    float32 checkpoint           -> float32
               bfloat16 / float16 checkpoint -> bfloat16 when `bf16()` says the CPU computes
                                               it natively (fp16 is never a CPU fast path),
                                               else float32
               quantized weights (`quantized`: blocks kept, engine/worker/quant) -> bfloat16
                                               where `bf16()` says native, else float32
                                               (the blocks carry no run dtype of their own)

    `bf16` is asked only on the CPU (tests pass a stand-in for the machine's answer).
    """
    if requested != "auto":
        if requested not in _DTYPES:
            raise ConfigError("model.dtype", f"must be one of auto, {', '.join(_DTYPES)}")
        dtype = _DTYPES[requested]
        why = f"model.dtype {requested}"
        if device.type == "cpu" and dtype == torch.float16:
            why += "; CPU fp16 is not a fast path"
        elif device.type == "cpu" and dtype == torch.bfloat16:
            support = bf16()
            why += "" if support.native else f"; {support.reason}"
        return DtypeChoice(dtype, why)
    if quantized and device.type == "cpu":
        support = bf16()
        dtype = torch.bfloat16 if support.native else torch.float32
        return DtypeChoice(dtype, f"quantized weights, activations: {support.reason}")
    name = checkpoint_dtype(hf_config)
    if name not in _DTYPES:
        why = f"checkpoint {name} is not a run dtype" if name else "checkpoint records no dtype"
        return DtypeChoice(torch.float32, why)
    recorded, why = _DTYPES[name], f"checkpoint {name}"
    if device.type != "cpu" or recorded == torch.float32:
        return DtypeChoice(recorded, why)
    support = bf16()
    if not support.native:
        return DtypeChoice(torch.float32, f"{why}; {support.reason}")
    if recorded == torch.float16:
        return DtypeChoice(torch.bfloat16, f"{why}, {support.reason}; CPU fp16 is not a fast path")
    return DtypeChoice(torch.bfloat16, f"{why}, {support.reason}")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shards: from model.safetensors.index.json, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir} has no *.safetensors weights (pytorch_model.bin is not supported)"
        )
    return files


def iter_weights(
    model_dir: Path,
    device: torch.device,
    select: Callable[[str], CheckpointSlice | None] | None = None,
    progress: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of every shard, with a progress bar over shards
    unless `progress` is False (tensor-parallel workers: rank 0 shows it).

    `select(name)`: the part of the tensor to read (a tensor-parallel rank's slice); None,
    or no `select`, reads all of it."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files = safetensors_files(model_dir)
    # safetensors opens straight onto CUDA; CPU tensors come from the memory map.
    target = str(device) if device.type in ("cpu", "cuda") else "cpu"
    bar = tqdm(files, desc="Loading safetensors shards", unit="shard", leave=False,
               disable=not progress)  # fmt: skip
    for f in bar:
        with safe_open(str(f), framework="pt", device=target) as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                part = select(name) if select is not None else None
                yield name, sf.get_tensor(name) if part is None else _read_slice(sf, name, part)


def _read_slice(sf: Any, name: str, part: CheckpointSlice) -> torch.Tensor:
    """Reads only `part` of tensor `name` from an open safetensors file."""
    if part.zeros:
        return torch.zeros_like(sf.get_tensor(name))  # a bias: one vector, read whole
    view = sf.get_slice(name)
    extent = view.get_shape()[part.dim]
    index = [slice(None)] * len(view.get_shape())
    index[part.dim] = slice(min(part.start, extent), min(part.stop, extent))
    t = view[tuple(index)]
    missing = part.length - t.shape[part.dim]
    if missing:  # vocabulary padding past the last row
        pad_shape = list(t.shape)
        pad_shape[part.dim] = missing
        t = torch.cat([t, t.new_zeros(pad_shape)], dim=part.dim)
    return t


def read_generation_config(model_dir: Path, hf_config: Any) -> dict[str, Any]:
    """generation_config.json as a dict; eos/bos/pad fall back to the model config's ids."""
    path = model_dir / "generation_config.json"
    gen: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if gen.get(key) is None and getattr(hf_config, key, None) is not None:
            gen[key] = getattr(hf_config, key)
    return gen


def build_model(
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
    plan: QuantPlan | None = None,
    lm_head: bool = True,
) -> nn.Module:
    """Our model class for the config (this rank's shard under `tp`), uninitialized on
    `device` (rope tables computed); with a `plan` that keeps blocks, its linears are
    quantized layers (engine/worker/quant/install.py); `lm_head` False: the decoder alone
    (embeddings)."""
    cls = resolve_architecture(getattr(hf_config, "architectures", None) or []).cls
    with torch.device("meta"):
        model = cls(hf_config, tp, lm_head=lm_head)
        if plan is not None and plan.blocks:
            install(model, plan, dtype)
    model = model.to(dtype=dtype).to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build(device)
    return model


def resolve_max_model_len(model_config: ModelConfig, hf_config: Any) -> int:
    """model.max_model_len, or the checkpoint's max_position_embeddings (4096 if it has
    none); ConfigError when the setting exceeds the checkpoint's."""
    native = getattr(hf_config, "max_position_embeddings", None) or 4096
    asked = model_config.max_model_len
    if asked is None:
        return native
    if asked > native:
        raise ConfigError(
            "model.max_model_len", f"{asked} exceeds the model's max_position_embeddings {native}"
        )
    return asked


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    tp: TensorParallel | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Resolve, build and load the model named by `model_config` onto `device`; under `tp`,
    this rank's shard of it. `progress`: show the shards' progress bar."""
    from transformers import AutoConfig

    start = time.perf_counter()
    source = find_model_source(model_config.path)
    gguf = source if source.suffix == ".gguf" else None
    model_dir = convert_gguf(source) if gguf else source
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    resolve_max_model_len(model_config, hf_config)  # a bad setting fails before the load
    index = gguf_index(model_dir) if gguf else None
    plan = resolve_plan(
        model_config.quantization,
        gguf_quantized=index is not None and gguf_has_quantized(index),
        hf_config=hf_config,
        device=device,
        group=model_config.quantization_group,
        activations=model_config.quant_activations,
    )
    arch = resolve_architecture(getattr(hf_config, "architectures", None) or [])
    task = resolve_task(model_config.task, model_dir, arch.name, arch.bare)
    pooling = read_pooling_spec(model_dir, hf_config, model_config) if task == "embed" else None
    choice = resolve_dtype(model_config.dtype, hf_config, device, quantized=plan.blocks)
    logger.info("%s", choice)
    logger.info("%s", plan.describe())
    if pooling is not None:
        logger.info("task embed: %s", pooling)
    dtype = choice.dtype
    model = build_model(hf_config, dtype, device, tp, plan, lm_head=task == "generate")
    if gguf is not None:
        weights = iter_gguf_weights(gguf, index, hf_config, device, model.checkpoint_slice, plan)
    elif plan.source is not None:  # pre-quantized: read whole on the CPU, converted, sliced
        raw = iter_weights(model_dir, torch.device("cpu"), None, progress)
        names = checkpoint_names(safetensors_files(model_dir))
        weights = iter_prequantized_weights(raw, names, device, model.checkpoint_slice, plan)
    else:
        weights = iter_weights(model_dir, device, model.checkpoint_slice, progress)
    model.load_weights(weights if task == "generate" else decoder_names(weights))
    if plan.blocks:
        logger.info("weights: %s", finalize_model(model))
    model.eval().requires_grad_(False)
    logger.info(
        "loaded %s (%s, %s) on %s in %.1f s",
        model_dir.name,
        type(model).__name__,
        str(dtype).removeprefix("torch."),
        device,
        time.perf_counter() - start,
    )
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        model_dir=model_dir,
        dtype=dtype,
        generation_config=read_generation_config(model_dir, hf_config),
        task=task,
        pooling=pooling,
    )


def decoder_names(
    weights: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A bare decoder's tensors (`layers.0...`, as sentence-transformers saves them) under
    the causal LM's names (`model.layers.0...`); names already prefixed pass through."""
    for name, tensor in weights:
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name
        yield name, tensor
