"""Which slice of each checkpoint tensor a tensor-parallel rank reads (Llama family names).

The loader asks `LlamaShardPlan.slice_for(hf_name)` for every tensor and reads only that
part from the safetensors file (`safe_open(...).get_slice`), so a rank never holds another
rank's weights, not even while loading. The slices follow `engine.worker.models.parallel`:

    q_proj / k_proj / v_proj   rows of this rank's query / KV heads (weight and bias)
    gate_proj / up_proj        rows of this rank's intermediate features
    o_proj / down_proj         columns (the input features this rank computes); their bias
                               is read on rank 0 only and is zero elsewhere, so the
                               all-reduce adds it once
    embed_tokens / lm_head     this rank's vocabulary rows, zero-padded past the vocabulary
    anything else              whole (norms, q/k norms: replicated)

A GGUF's or a pre-quantized checkpoint's tensors are read whole and converted first (their
packed layouts do not slice where the float ones do); `slice_loaded` then cuts the
converted weight (q4 / q8 blocks at 32-column block boundaries, fp8 rows anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ConfigError
from engine.worker.models.parallel import HeadShard, TensorParallel, even_split, vocab_rows


@dataclass(frozen=True)
class CheckpointSlice:
    """Indices [start, stop) along `dim` of a checkpoint tensor, zero-padded to `length`
    along `dim` (rows past the vocabulary); `zeros`: the tensor's shape, all zeros."""

    dim: int
    start: int
    stop: int
    length: int
    zeros: bool = False


class LlamaShardPlan:
    """Maps HF tensor names of Llama/Mistral/Qwen2/Qwen3 checkpoints to this rank's slice."""

    def __init__(self, hf_config: Any, heads: HeadShard, head_dim: int, tp: TensorParallel):
        d = head_dim
        i_start, i_len = even_split(hf_config.intermediate_size, tp, "intermediate_size")
        v_start, v_rows = vocab_rows(hf_config.vocab_size, tp)
        q = (heads.q_start * d, heads.num_heads * d)
        kv = (heads.kv_start * d, heads.num_kv_heads * d)
        inter = (i_start, i_len)
        self._rows = {
            "q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": inter, "up_proj": inter,
        }  # fmt: skip
        self._cols = {"o_proj": q, "down_proj": inter}
        self._vocab = (v_start, v_rows)
        self._rank = tp.rank

    def slice_for(self, name: str) -> CheckpointSlice | None:
        """This rank's part of checkpoint tensor `name`; None: all of it."""
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if module in self._rows:
            start, n = self._rows[module]
            return CheckpointSlice(0, start, start + n, n)
        if module in self._cols:
            if kind == "bias":
                return None if self._rank == 0 else CheckpointSlice(0, 0, 0, 0, zeros=True)
            start, n = self._cols[module]
            return CheckpointSlice(1, start, start + n, n)
        if module in ("embed_tokens", "lm_head") and kind == "weight":
            start, n = self._vocab
            return CheckpointSlice(0, start, start + n, n)
        return None


def slice_loaded(t: Any, part: CheckpointSlice, name: str) -> Any:
    """`part` of a tensor already read whole: a float tensor, or a converted weight with
    its own `narrow(dim, start, stop, length)` (BlockTensor, Fp8Rows). A slice that cuts
    through a block is a ConfigError on parallel.tensor_parallel_size."""
    if part.zeros:
        return torch.zeros(t.shape)
    if not isinstance(t, torch.Tensor):
        try:
            return t.narrow(part.dim, part.start, part.stop, part.length)
        except ValueError as e:
            raise ConfigError("parallel.tensor_parallel_size", f"{name}: {e}") from None
    stop = min(part.stop, t.shape[part.dim])
    out = t.narrow(part.dim, min(part.start, stop), stop - min(part.start, stop))
    missing = part.length - out.shape[part.dim]
    if missing:
        pad = list(out.shape)
        pad[part.dim] = missing
        out = torch.cat([out, out.new_zeros(pad)], dim=part.dim)
    return out.contiguous()
