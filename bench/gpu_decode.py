"""GPU decode speed: model-level decode steps with and without CUDA graphs, in bf16.

Runs on the lent H200 as the `decode` phase of scripts/gpu_check.sh (see docs/gpu.md), on
random weights of Llama-3-8B's shape built directly in GPU memory (bench/random_model.py;
nothing is written to disk). Each step: metadata, forward, logits, greedy ids back to the
host, at each batch size with `--context` tokens of context, eager vs CUDA graphs
(GraphRunner), with the attention backend the runner picks (FlashInfer when it works).

Results are written to --out after every measurement, so a run cut short keeps what it
measured. Any error is printed with its traceback, recorded under "errors" and makes the
exit status 1: a crash can never pass as a result. `--smoke --device cpu` runs the same code
on tiny dims (the CPU dry run; on the CPU "graphs" runs GraphRunner's padded buffers eagerly).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.random_model import LLAMA3_8B, TINY, random_model  # noqa: E402
from engine.worker.attention.base import AttentionMetadata, ForwardContext  # noqa: E402

BLOCK = 16


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def decode_metadata(tables: np.ndarray, seq_len: int, dev: torch.device) -> AttentionMetadata:
    """A decode step for every row of `tables`, each request holding `seq_len` tokens after it."""
    n, pos = tables.shape[0], seq_len - 1
    slots = tables[:, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK

    def to(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype)

    return AttentionMetadata(
        num_reqs=n, num_tokens=n, query_start_loc=to(np.arange(n + 1), torch.int32),
        seq_lens=to(np.full(n, seq_len), torch.int32), block_tables=to(tables, torch.int32),
        slot_mapping=to(slots, torch.int64), positions=to(np.full(n, pos), torch.int64),
        max_query_len=1, max_seq_len=seq_len, query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=[seq_len] * n, block_size=BLOCK,
    )  # fmt: skip


@torch.inference_mode()
def decode_rate(model, backend, caches, gr, dev, batch: int, per_seq: int, context: int,
                steps: int) -> dict:  # fmt: skip
    """tokens/s of `steps` decode steps at `batch` (after 3 warm-up steps)."""
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    ids = torch.randint(0, 1000, (batch,), device=dev)
    warm = 3
    t0 = time.perf_counter()
    for s in range(warm + steps):
        if s == warm:
            _sync(dev)
            t0 = time.perf_counter()
        md = decode_metadata(tables, context + s + 1, dev)
        if gr is not None:
            step = SimpleNamespace(input_ids=ids, positions=md.positions, attn_metadata=md)
            hidden = gr.run(step)
        else:
            backend.begin_step(md)
            hidden = model(ids, md.positions, ForwardContext(md, caches, backend))
        nxt = model.compute_logits(hidden).argmax(-1).tolist()  # host round trip, like sampling
        ids = torch.tensor(nxt, device=dev)
    dt = time.perf_counter() - t0
    return dict(tokens_per_s=round(batch * steps / dt, 1), ms_per_step=round(1e3 * dt / steps, 3))


def replay_ms(gr, dev: torch.device, batch: int, per_seq: int, context: int, reps: int) -> float:
    """ms per decode step with the host's round trip taken out: one step's inputs replayed
    `reps` times back to back (the plan and input copies still run on the host, the logits,
    argmax and `.tolist()` do not), synchronized once. Against `decode_rate` this splits a
    step into what the GPU does and what the serial host loop adds."""
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    md = decode_metadata(tables, context + 1, dev)
    step = SimpleNamespace(input_ids=torch.randint(0, 1000, (batch,), device=dev),
                           positions=md.positions, attn_metadata=md)  # fmt: skip
    for _ in range(3):
        gr.run(step)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        gr.run(step)
    _sync(dev)
    return round(1e3 * (time.perf_counter() - t0) / reps, 3)


# Peak HBM read bandwidth by device name (vendor figures), for the batch-1 roofline.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 NVL": 3.9e12,
                   "H100 PCIe": 2.0e12}  # fmt: skip


def hbm_bytes_per_s(dev: torch.device) -> float | None:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""
    return next((v for k, v in HBM_BYTES_PER_S.items() if k in name), None)


def roofline_b1(weight_bytes: int, ms: float, dev: torch.device) -> dict | str:
    """Batch 1 reads every weight once per token: the share of the device's peak it reaches."""
    hbm = hbm_bytes_per_s(dev)
    if hbm is None:
        return f"no HBM figure for {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev}"
    return dict(hbm_bytes_per_s=hbm, weight_read_ms=round(1e3 * weight_bytes / hbm, 3),
                share=round(weight_bytes / hbm / (ms / 1e3), 3))  # fmt: skip


def decode_modes(model, backend, dev: torch.device, batches: list[int], context: int,
                 steps: int, res: dict, save: Callable[[], None], kv_dtype: torch.dtype | None = None,
                 key: str = "decode") -> None:  # fmt: skip
    """res[f"{key}_{eager|graphs}_b{batch}"]: `decode_rate` over fresh caches of `kv_dtype`
    (default the model's; fp8 pages), eagerly and through a captured GraphRunner."""
    from engine.worker.attention.kv_dtype import new_kv_cache
    from engine.worker.decode_graphs import GraphRunner
    from graphs.buckets import capture_sizes

    dtype = next(model.parameters()).dtype
    per_seq = math.ceil((context + steps + 8) / BLOCK)
    max_b = max(batches)
    shape = (max_b * per_seq, 2, BLOCK, model.num_kv_heads, model.head_dim)
    kv = kv_dtype or dtype
    caches = [new_kv_cache(shape, kv, dev) for _ in range(model.num_layers)]
    for mode in ("eager", "graphs"):
        gr = None
        if mode == "graphs":
            if dev.type == "cuda" and not getattr(backend, "supports_cuda_graphs", False):
                res[f"{key}_graphs_skipped"] = f"{backend.name} backend cannot be captured"
                continue
            sizes = capture_sizes(None, max_b)
            gr = GraphRunner(model, backend, caches, sizes, dev, block_size=BLOCK,
                             max_blocks_per_seq=per_seq, dtype=dtype)  # fmt: skip
            st = gr.capture()
            res[f"{key}_graph_capture"] = dict(
                seconds=round(st.capture_seconds, 2), buckets=len(sizes),
                memory_mib=round(st.graph_memory_bytes / 2**20), replayed=gr.use_graphs,
            )  # fmt: skip
        for b in batches:
            res[f"{key}_{mode}_b{b}"] = decode_rate(
                model, backend, caches, gr, dev, b, per_seq, context, steps
            )
            if gr is not None:
                res[f"{key}_{mode}_b{b}"]["replay_ms"] = replay_ms(
                    gr, dev, b, per_seq, context, steps
                )
            save()
        del gr
    del caches
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def bench_decode(dims: dict, dev: torch.device, batches: list[int], context: int, steps: int,
                 res: dict, save: Callable[[], None]) -> None:  # fmt: skip
    from engine.worker.attention.selection import select_attention_backend

    dtype = torch.bfloat16
    t0 = time.perf_counter()
    model = random_model(dims, dev, dtype)
    _sync(dev)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    res["model"] = dict(weight_gib=round(weight_bytes / 2**30, 2),
                        build_seconds=round(time.perf_counter() - t0, 2), dims=dims)  # fmt: skip
    choice = select_attention_backend(
        dev, dtype, specs=model.attention_specs, block_size=BLOCK
    )  # on CUDA: the start-up probe over the model's layers, then FlashInfer or the fallback
    backend = choice.backend
    res["decode_backend"] = backend.name
    res["attention_fallback_reason"] = choice.fallback_reason
    decode_modes(model, backend, dev, batches, context, steps, res, save)
    if dev.type == "cuda":  # batch 1 reads every weight once per token
        if "decode_graphs_b1" in res:
            b1 = res["decode_graphs_b1"]
            res["roofline_b1"] = roofline_b1(weight_bytes, b1["ms_per_step"], dev)
            res["roofline_b1_replay"] = roofline_b1(weight_bytes, b1["replay_ms"], dev)
        else:
            res["roofline_b1"] = "not measured: no graphs run at batch 1"
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def run_parts(parts: dict[str, Callable[[], None]], res: dict) -> list[str]:
    """Runs each part; an error is printed in full, kept in res["errors"] and returned."""
    failed = []
    for name, part in parts.items():
        try:
            part()
        except Exception as e:  # noqa: BLE001 - reported and turned into the exit status
            traceback.print_exc()
            res.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
            failed.append(name)
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "decode.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny dims (checks the script on a CPU)")
    ap.add_argument("--batches", default=None, help="default 1,8,64,256 (smoke: 1,4)")
    ap.add_argument("--context", type=int, default=None, help="default 512 (smoke: 40)")
    ap.add_argument("--steps", type=int, default=None, help="default 32 (smoke: 3)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    batches = [int(b) for b in (args.batches or ("1,4" if smoke else "1,8,64,256")).split(",")]
    context = args.context or (40 if smoke else 512)
    steps = args.steps or (3 if smoke else 32)
    dev = torch.device(args.device)
    res: dict[str, Any] = dict(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        torch=torch.__version__, context=context, steps=steps, smoke=smoke,
    )  # fmt: skip

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, sort_keys=True))

    start = time.monotonic()
    dims = TINY if smoke else LLAMA3_8B
    failed = run_parts(
        {"decode": lambda: bench_decode(dims, dev, batches, context, steps, res, save)}, res
    )
    res["wall_seconds"] = round(time.monotonic() - start, 1)
    save()
    print(json.dumps(res, indent=1, sort_keys=True))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
