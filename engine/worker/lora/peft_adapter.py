"""Reads a PEFT LoRA adapter directory into checked CPU tensors, or refuses it by name.

A PEFT adapter is two files::

    adapter_config.json         r, lora_alpha, use_rslora, target_modules, rank_pattern, ...
    adapter_model.safetensors   base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
                                [r, in] and ...lora_B.weight [out, r], per targeted module

A targeted linear computes ``W x + scale * B (A x)`` with ``scale = alpha / r``, or
``alpha / sqrt(r)`` under rsLoRA; ``rank_pattern`` and ``alpha_pattern`` override r and
alpha per module, matched the way PEFT matches them (a pattern key matches a module name
that ends with it, as a regex, after an optional ``prefix.``; the first key that matches
wins). Each module's scale is folded into its B here, once.

Supported: LoRA on q/k/v/o_proj and gate/up/down_proj of every decoder layer, any rank up to
`lora.max_lora_rank`. Everything that changes the computation in another way is refused
with a message naming it (DoRA, LoRA biases, embeddings or the LM head, modules_to_save,
layer replication, other LoRA variants), as are shapes that do not fit the base model.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch

from engine.errors import LoRAError, LoRAPathError
from engine.lora_request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, by their HF names, and the block holding each.
SUPPORTED_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY = re.compile(r"^model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")
_PREFIX = "base_model.model."
# Config fields that, when set, mean a computation other than plain LoRA on the targets.
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (use_dora) is not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices (embedding rows) is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "velora_config": "VeLoRA (velora_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
}


@dataclass(frozen=True)
class ProjectionShape:
    in_features: int
    out_features: int


@dataclass(frozen=True)
class LoRAShapes:
    """What the base model offers adapters: its layer count and, per HF projection name,
    the shape of that projection (the same in every layer)."""

    num_layers: int
    projections: Mapping[str, ProjectionShape]


@dataclass(frozen=True, eq=False)
class LoRAWeights:
    """One adapter, checked and ready for the device slots.

    `key` is a SHA-256 of both files: the prefix-cache key (two adapters never share KV
    unless their files are identical) and the slots' identity for the weights.
    """

    lora: LoRARequest
    key: bytes
    rank: int  # the largest rank of its modules
    # (layer, HF projection name) -> (A [r, in], scale * B [out, r]) in the run dtype, CPU.
    modules: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def load_peft_adapter(
    lora: LoRARequest, shapes: LoRAShapes, max_rank: int, dtype: torch.dtype
) -> LoRAWeights:
    """Reads and checks `lora.lora_path`; raises `LoRAError` naming the adapter and the
    problem. Reads files only: safe on any thread."""
    where = f"LoRA adapter {lora.lora_name!r} ({lora.lora_path})"
    try:
        if lora.allowed_dirs:
            config_bytes, weights_bytes = (
                read_confined(Path(lora.lora_path) / name, lora.allowed_dirs)
                for name in (CONFIG_FILE, WEIGHTS_FILE)
            )
        else:
            config_bytes, weights_bytes = _read_files(Path(lora.lora_path))
        config = _parse_config(config_bytes)
        modules = _read_modules(config, weights_bytes, shapes, max_rank, dtype)
    except LoRAError as e:
        raise type(e)(f"{where}: {e}") from None  # LoRAPathError stays one (a 403)
    digest = sha256(config_bytes)
    digest.update(weights_bytes)
    rank = max(a.shape[0] for a, _ in modules.values())
    return LoRAWeights(lora, digest.digest(), rank, modules)


def _read_files(path: Path) -> tuple[bytes, bytes]:
    if not path.is_dir():
        raise LoRAError("the directory does not exist" if not path.exists() else "not a directory")
    config, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config.is_file():
        raise LoRAError(f"{CONFIG_FILE} is missing")
    if not weights.is_file():
        extra = " (adapter_model.bin is not read; save with safe_serialization)"
        raise LoRAError(
            f"{WEIGHTS_FILE} is missing" + (extra if (path / "adapter_model.bin").exists() else "")
        )
    try:
        return config.read_bytes(), weights.read_bytes()
    except OSError as e:
        raise LoRAError(f"cannot read the adapter files: {e}") from None


def read_confined(path: Path, roots: tuple[str, ...]) -> bytes:
    """The bytes of the file at `path`, which must really lie under one of `roots` (real
    paths). The file is opened once and the check and the read use that descriptor: its
    path as the kernel resolved it (/proc/self/fd) must be inside a root, so a symlink
    swapped between a check and the read cannot point the read elsewhere. A path that
    resolves outside is refused (LoRAPathError) before anything is opened, and with the
    same message whether its target exists or not; only files inside may be reported
    missing or unreadable."""
    name = path.name
    outside = LoRAPathError(f"{name} lies outside lora.allowed_dirs (symlinks resolved)")
    if not _inside(os.path.realpath(path), roots):
        raise outside
    try:
        # O_NOFOLLOW on the resolved path: its last part cannot have become a symlink since.
        fd = os.open(os.path.realpath(path), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise LoRAError(f"{name} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise outside from None
        raise LoRAError(f"{name} cannot be read: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        opened = _fd_path(f.fileno())
        if opened is not None and not _inside(opened, roots):
            raise outside
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise LoRAError(f"{name} is not a regular file")
        return f.read()


def _fd_path(fd: int) -> str | None:
    """The path the kernel opened `fd` at (Linux); None where that cannot be read."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _inside(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _parse_config(raw: bytes) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"peft_type {peft_type!r} is not supported (only LORA)")
    for flag, why in _UNSUPPORTED_FLAGS.items():
        if config.get(flag):
            raise LoRAError(why)
    if config.get("bias", "none") != "none":
        raise LoRAError(f"bias {config['bias']!r} is not supported (only 'none')")
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAError(f"{name} must be a positive number, got {value!r}")
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(name) or {}, dict):
            raise LoRAError(f"{name} must be an object mapping module patterns to numbers")
    _check_target_modules(config.get("target_modules"))
    return config


def _check_target_modules(targets: Any) -> None:
    """A list names modules (or full module paths); a string is a regex or "all-linear",
    whose matches show in the weights file and are checked there."""
    if targets is None or isinstance(targets, str):
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoRAError("target_modules must be a list of module names or a string")
    bad = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED_MODULES})
    if bad:
        raise LoRAError(
            f"target_modules {bad} are not supported; adapters may target "
            f"{', '.join(SUPPORTED_MODULES)}"
        )


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule: the first pattern key that matches the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_modules(
    config: dict[str, Any],
    raw: bytes,
    shapes: LoRAShapes,
    max_rank: int,
    dtype: torch.dtype,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import load as load_safetensors

    try:
        tensors = load_safetensors(raw)
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise LoRAError(f"{WEIGHTS_FILE} cannot be read: {e}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, proj, which = _parse_key(key, shapes.num_layers)
        pairs.setdefault((layer, proj), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"{WEIGHTS_FILE} holds no LoRA weights")
    use_rslora = bool(config.get("use_rslora"))
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    modules = {}
    for (layer, proj), ab in sorted(pairs.items()):
        name = f"model.layers.{layer}.{SUPPORTED_MODULES[proj]}.{proj}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAError(f"{name} has no {missing} weight")
        a, b = ab["A"], ab["B"]
        shape = shapes.projections[proj]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.shape != (r, shape.in_features) or b.shape != (shape.out_features, r):
            raise LoRAError(
                f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"base model's {proj} ({shape.in_features} in, {shape.out_features} out): "
                f"expected [r, {shape.in_features}] and [{shape.out_features}, r]"
            )
        expected = _pattern_value(ranks, name, config["r"])
        if r != expected:
            raise LoRAError(f"{name} has rank {r} but the config gives it r={expected}")
        if r > max_rank:
            raise LoRAError(f"{name} has rank {r}, above lora.max_lora_rank {max_rank}")
        alpha = _pattern_value(alphas, name, config["lora_alpha"])
        scale = alpha / math.sqrt(r) if use_rslora else alpha / r
        modules[(layer, proj)] = (
            a.to(torch.float32).to(dtype).contiguous(),
            (b.to(torch.float32) * scale).to(dtype).contiguous(),
        )
    return modules


def _parse_key(key: str, num_layers: int) -> tuple[int, str, str]:
    """(layer, projection, "A" or "B") of a weights-file key, or LoRAError naming it."""
    m = _KEY.match(key.removeprefix(_PREFIX))
    supported = ", ".join(SUPPORTED_MODULES)
    if m is None:
        raise LoRAError(
            f"tensor {key!r} is not a LoRA weight of a supported module ({supported}); "
            "embeddings, the LM head, DoRA magnitudes and LoRA biases are not supported"
        )
    layer, block, proj, which = int(m[1]), m[2], m[3], m[4]
    if SUPPORTED_MODULES.get(proj) != block:
        raise LoRAError(f"tensor {key!r} targets {block}.{proj}; supported: {supported}")
    if layer >= num_layers:
        raise LoRAError(f"tensor {key!r} is for layer {layer}; the base model has {num_layers}")
    return layer, proj, which
