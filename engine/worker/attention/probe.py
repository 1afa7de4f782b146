"""The start-up probe: a backend must plan and run a tiny decode and a causal prefill with the
model's head layout, and agree with the torch backend, before the engine serves with it.

FlashInfer builds its kernels (JIT) and allocates lazily, at the first `plan()`/`run()`: done
here, a failed build, a missing kernel for this GPU or a launch error shows up at start-up
with its reason, not inside KV sizing, graph capture or a served step. It also leaves every
wrapper the model needs (one decode and one prefill wrapper per kind of layer) built and
planned once, so the first request does not pay for it.

Per distinct layer kind (heads, head_dim, scale, window, soft cap) two steps run on a small
private paged cache, with blocks handed out out of order:

    decode:   2 requests, 1 new token each, contexts `long` and 3 tokens
    prefill:  a 5-token prompt (plain causal) and a 3-token chunk behind `long - 3` cached
              tokens (causal, bottom-right aligned)

`long` spans more than two blocks and, for a sliding-window layer, more than the window, so
the window and the page indirection are both exercised. Outputs must be within `TOLERANCE`
of the torch backend's (bf16 rounding, not a different attention) and the caches equal.

With fp8 pages (`kv_dtype`) the backend writes and reads e4m3; the reference runs in the
model's dtype on the same values (the cache and the new K/V rounded through e4m3 first,
exact in bf16/fp16), so the same tolerance holds, and the backend's pages must equal the
reference's cache cast to e4m3, byte for byte. A kernel that read the bytes as anything but
e4m3, or a write that cast them otherwise, fails here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.worker.attention.base import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
)
from engine.worker.attention.kv_dtype import page_bytes, to_fp8
from engine.worker.attention.torch_paged import TorchPagedBackend

# |probe - torch| <= ATOL + RTOL * |torch|, element-wise. Outputs are averages of N(0, 1)
# values (|out| < ~1); bf16 keeps 8 bits, so rounding stays near 1e-2, while a dropped window,
# soft cap or scale, or a wrong page, moves outputs by tenths.
ATOL = 5e-2
RTOL = 5e-2


class AttentionProbeError(RuntimeError):
    """The backend ran but disagrees with the torch backend; the message says where."""


def probe_attention(
    backend: AttentionBackend,
    specs: Iterable[AttentionLayerSpec],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
) -> None:
    """Run the decode and prefill probes for each distinct layer kind; raise on the first
    failure (the backend's own error, or `AttentionProbeError`). `dtype`: the model's (the
    queries'); `kv_dtype`: the pages' (default `dtype`; fp8 pages)."""
    reference = TorchPagedBackend(native=False)
    kv_dtype = kv_dtype or dtype
    for spec in dict.fromkeys(specs):  # distinct, in layer order
        long = max(2 * block_size + 1, (spec.sliding_window or 0) + block_size + 1)
        for name, q_lens, seq_lens in (
            ("decode", [1, 1], [long, 3]),
            ("causal prefill", [5, 3], [5, long]),
        ):
            _compare(backend, reference, spec, name, q_lens, seq_lens, block_size, dtype,
                     kv_dtype, device)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # an asynchronous launch error surfaces here, not later


def _compare(backend, reference, spec, name, q_lens, seq_lens, block_size, dtype, kv_dtype,
             device):  # fmt: skip
    md, num_blocks = _probe_metadata(q_lens, seq_lens, block_size, device)
    gen = torch.Generator(device=device).manual_seed(0)
    T, H, Hkv, D = md.num_tokens, spec.num_heads, spec.num_kv_heads, spec.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    cache = randn(num_blocks, 2, block_size, Hkv, D)
    q, k, v = randn(T, H, D), randn(T, Hkv, D), randn(T, Hkv, D)
    pages = cache.to(kv_dtype) if kv_dtype == dtype else to_fp8(cache)
    caches = [pages.clone(), pages.to(dtype, copy=True)]  # the reference reads their values
    kv_in = [(k, v), (k, v) if kv_dtype == dtype else (to_fp8(k).to(dtype), to_fp8(v).to(dtype))]
    outs = []
    for b, c, (kk, vv) in zip((backend, reference), caches, kv_in, strict=True):
        b.begin_step(md)
        outs.append(b.forward(q, kk, vv, c, md, spec).float())
    got, want = outs
    where = f"{name} probe for {spec}"
    written = caches[1] if kv_dtype == dtype else to_fp8(caches[1])
    if not torch.equal(page_bytes(caches[0]), page_bytes(written)):
        raise AttentionProbeError(f"{where}: the KV cache written differs from the torch backend's")
    err = (got - want).abs()
    bad = ~(err <= ATOL + RTOL * want.abs())  # NaN counts as bad
    if bool(bad.any()):
        raise AttentionProbeError(
            f"{where}: {int(bad.sum())} of {bad.numel()} outputs differ from the torch backend "
            f"beyond {ATOL} + {RTOL}*|ref| (largest {float(err.nan_to_num(float('inf')).max()):.3g})"
        )


def _probe_metadata(
    q_lens: list[int], seq_lens: list[int], block_size: int, device: torch.device
) -> tuple[AttentionMetadata, int]:
    """Metadata over block tables handed out last block first; (metadata, blocks needed)."""
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 1  # block 0 stays unused: a pad entry never aliases live K/V
    free = list(range(num_blocks - 1, 0, -1))
    tables = [[free.pop(0) for _ in range(n)] for n in pages]
    starts, positions, slots = [0], [], []
    for n, s, table in zip(q_lens, seq_lens, tables, strict=True):
        starts.append(starts[-1] + n)
        for p in range(s - n, s):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    width = max(pages)
    padded = [t + [0] * (width - len(t)) for t in tables]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    md = AttentionMetadata(
        num_reqs=len(q_lens),
        num_tokens=starts[-1],
        query_start_loc=tensor(starts, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(padded, torch.int32),
        slot_mapping=tensor(slots, torch.int64),
        positions=tensor(positions, torch.int64),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
    )
    return md, num_blocks
