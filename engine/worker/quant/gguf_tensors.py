"""GGUF tensors read with the `gguf` package's reader, mapped to HF names and to the nearest
format our linears take, without a float32 detour where a kernel takes the bytes:

    F32 / F16 / BF16    float tensors
    Q4_1, Q8_0          byte for byte (they *are* the q4 / q8 block layouts)
    Q4_0                q4: same nibbles, m = -8 d (exact)
    Q5_0                q8: q - 16 fits int8, same d (exact)
    Q4_K                q4: each 32-weight sub-block's d * scale and dmin * min, rounded to
                        fp16 (the only change: ~2^-12 relative on a scale)
    Q5_1, Q5_K, Q6_K    q8 from `gguf.quants.dequantize` (re-gridded to 8 bits per block;
                        no kernel takes 5/6-bit codes)
    anything else       refused (`UnsupportedGGUFTensor`: the loader raises ConfigError)

llama.cpp's converter permutes the rows of q and k for the `llama` architecture (its rotary
kernel pairs adjacent features, HF's pairs halves); `read_gguf_tensors` undoes that on the
raw rows, which are whole blocks, so no weight is dequantized for it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.worker.quant.blocks import BLOCK, BlockTensor, pack_q4, pack_q8, quantize_q8

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SKIP = ("rope_freqs.weight",)  # llama3 rope factors: recomputed from the config
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


class UnsupportedGGUFTensor(ValueError):
    """A GGUF tensor whose type or name we cannot map (names the tensor and the type)."""


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name for a GGUF tensor name; None for tensors we recompute."""
    if gguf_name in _SKIP:
        return None
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLK.match(gguf_name)
    if m:
        layer, rest = m.groups()
        if rest in _LAYER:
            return f"model.layers.{layer}.{_LAYER[rest]}"
        stem, _, leaf = rest.rpartition(".")
        if stem in _LAYER and leaf in ("weight", "bias"):
            return f"model.layers.{layer}.{_LAYER[stem]}.{leaf}"
    raise UnsupportedGGUFTensor(f"GGUF tensor {gguf_name!r} has no counterpart in our models")


def _half_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.float16).astype(np.float32)[..., 0]


def _q4_0(raw: np.ndarray) -> BlockTensor:  # [N, nb * 18]
    n = raw.shape[0]
    b = raw.reshape(n, -1, 18)
    d = b[..., 0:2]
    m = (_half_bytes(d) * -8.0).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    data = np.concatenate([d, m, b[..., 2:18]], axis=-1).reshape(n, -1)
    return BlockTensor(4, torch.from_numpy(np.ascontiguousarray(data)), b.shape[1] * BLOCK)


def _q5_0(raw: np.ndarray) -> BlockTensor:  # [N, nb * 22]: d, qh (4 bytes), qs (16)
    n = raw.shape[0]
    b = raw.reshape(n, -1, 22)
    qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)[..., 0]  # [N, nb]
    qs = b[..., 6:22].astype(np.int16)
    bits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [N, nb, 32]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (bits.astype(np.int16) << 4)
    q = torch.from_numpy((q - 16).astype(np.int8).reshape(n, -1))
    d = torch.from_numpy(_half_bytes(b[..., 0:2]))
    return pack_q8(q, d)


def _q4_k(raw: np.ndarray) -> BlockTensor:  # [N, nb * 144]: d, dmin, scales[12], qs[128]
    n = raw.shape[0]
    b = raw.reshape(n, -1, 144)
    d, dmin = _half_bytes(b[..., 0:2]), _half_bytes(b[..., 2:4])
    s = b[..., 4:16].astype(np.int32)  # the 6-bit scales and mins of 8 sub-blocks
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 16:144].reshape(n, -1, 4, 32)  # 4 chunks of 64 weights: low nibbles, high
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1)  # [N, K] in order
    sub_d = (d[..., None] * sc).reshape(n, -1)
    sub_m = (-dmin[..., None] * mn).reshape(n, -1)
    return pack_q4(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(sub_d),
                   torch.from_numpy(sub_m))  # fmt: skip


def _via_dequantize(raw: np.ndarray, qtype: Any, cols: int) -> BlockTensor:
    from gguf.quants import dequantize

    w = dequantize(raw, qtype).reshape(raw.shape[0], cols)
    return quantize_q8(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)))


def _converter(qtype: Any, cols: int) -> Callable[[np.ndarray], torch.Tensor | BlockTensor]:
    from gguf import GGMLQuantizationType as T

    if qtype in (T.F32, T.F16):
        return lambda raw: torch.from_numpy(np.array(raw, dtype=np.float32, copy=True))
    if qtype == T.BF16:
        return lambda raw: torch.from_numpy(np.array(raw, copy=True)).view(torch.bfloat16)
    if qtype == T.Q4_1:
        return lambda raw: BlockTensor(4, torch.from_numpy(np.array(raw, copy=True)), cols)
    if qtype == T.Q8_0:
        return lambda raw: BlockTensor(8, torch.from_numpy(np.array(raw, copy=True)), cols)
    if qtype == T.Q4_0:
        return _q4_0
    if qtype == T.Q5_0:
        return _q5_0
    if qtype == T.Q4_K:
        return _q4_k
    if qtype in (T.Q5_1, T.Q5_K, T.Q6_K):
        return lambda raw: _via_dequantize(raw, qtype, cols)
    raise UnsupportedGGUFTensor(f"type {qtype.name}")


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF halves <- interleaved pairs), on raw rows."""
    n = rows.shape[0]
    return (
        rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lies in the file (from the `gguf` reader, recorded once)."""

    name: str
    type: str  # GGMLQuantizationType name
    shape: tuple[int, ...]  # ggml order: shape[0] is the inner (input) dimension
    offset: int  # absolute byte offset of the data
    nbytes: int


def index_gguf(path: str | Path) -> dict[str, Any]:
    """{'architecture', 'tensors': [GGUFTensorInfo as dict]} read by `gguf.GGUFReader`.

    The reader parses every metadata field (the tokenizer's ~50k strings) in Python, seconds
    per start; the loader records this index once beside the config and reads tensors by
    offset afterwards."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    tensors = [
        GGUFTensorInfo(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape),
                       int(t.data_offset), int(t.n_bytes)).__dict__
        for t in reader.tensors
    ]  # fmt: skip
    return {"architecture": arch, "tensors": tensors}


def _raw(mm: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes as [rows, row bytes] (quantized) or its float array [rows, cols]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[info.type]
    data = mm[info.offset : info.offset + info.nbytes]
    rows = int(np.prod(info.shape[1:])) if len(info.shape) > 1 else 1
    floats = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
    if info.type in floats:
        arr = data.view(floats[info.type])
        return arr.reshape(rows, info.shape[0]) if len(info.shape) > 1 else arr
    block, nbytes = GGML_QUANT_SIZES[qtype]
    return data.reshape(rows, info.shape[0] // block * nbytes)


def read_gguf_tensors(
    path: str | Path, index: dict[str, Any], hf_config: Any, keep_blocks: bool = True
) -> Iterator[tuple[str, torch.Tensor | BlockTensor, str]]:
    """(HF name, float tensor or BlockTensor, GGUF type name) for every tensor of the file
    (`index` from `index_gguf`); with `keep_blocks` False every tensor is float (quantized
    ones dequantized by `gguf.quants.dequantize`).

    Raises UnsupportedGGUFTensor naming the tensor and its type for one we cannot map."""
    from gguf import GGMLQuantizationType

    mm = np.memmap(str(path), dtype=np.uint8, mode="r")
    permute = index["architecture"] == "llama"
    heads = {"q_proj": hf_config.num_attention_heads,
             "k_proj": getattr(hf_config, "num_key_value_heads", None)
             or hf_config.num_attention_heads}  # fmt: skip
    for entry in index["tensors"]:
        t = GGUFTensorInfo(**{**entry, "shape": tuple(entry["shape"])})
        name = hf_name(t.name)
        if name is None:
            continue
        cols = int(t.shape[0])  # ggml order: ne0 is the inner (input) dimension
        qtype = GGMLQuantizationType[t.type]
        try:
            convert = _converter(qtype, cols)
        except UnsupportedGGUFTensor as e:
            raise UnsupportedGGUFTensor(
                f"GGUF tensor {t.name!r} has type {e}, which no kernel here takes "
                "(supported: F32, F16, BF16, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0)"
            ) from None
        raw = _raw(mm, t)
        proj = name.split(".")[-2] if name.count(".") >= 2 else ""
        if permute and proj in heads:
            raw = _unpermute(raw, heads[proj])
        if not keep_blocks and t.type not in ("F32", "F16", "BF16"):
            from gguf.quants import dequantize

            w = dequantize(raw, qtype).reshape(raw.shape[0], cols)
            yield name, torch.from_numpy(np.ascontiguousarray(w, np.float32)), t.type
            continue
        yield name, convert(raw), t.type
