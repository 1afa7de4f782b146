"""Decode attention at W64's shape: the C paged-attention kernel against the box's read speed.

W64 on llama50m decodes 64 requests of 32-256 prompt tokens for 128 steps; each decode step
runs the kernel once a layer over every request's K and V (4 KV heads x 64, 8 query heads,
16-token blocks). This times those calls alone, over 8 layers' caches cycled (so a layer's
KV is not still in L2 from its last call), for each `--dtypes` and block layout:

- `engine`: the block order our pool hands out for W64 (each prompt's blocks in a row, the
  decode blocks interleaved across requests as they fill);
- `random`: every block anywhere in the pool.

Reported per layer call: median and best ms over `--repeats` passes, the bytes of K and V it
must read, and GB/s against `torch.sum` over the same bytes in 8 tensors (what two cores
read when nothing else is done with the data) measured in the same run. One JSON line per
(dtype, layout) goes to bench/results/paged_attention.jsonl (`--no-write`: none).

    python bench/paged_attention.py                         # bf16 + fp32, both layouts
    python bench/paged_attention.py --dtypes bfloat16 --decoded 500
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, LoadMeter, base_record, log, write_jsonl  # noqa: E402

REQUESTS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 64, 8, 4, 64, 16, 8


def block_tables(lens: list[int], decoded: int, layout: str, pool: int, rng: random.Random):
    import torch

    width = max(-(-n // BLOCK) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    order = list(range(pool))
    if layout == "random":
        rng.shuffle(order)
    nxt = iter(order)
    prompts = [n - decoded for n in lens]
    for r, n in enumerate(prompts):  # prefill: each prompt's blocks in a row
        for b in range(-(-n // BLOCK)):
            tables[r, b] = next(nxt)
    for step in range(decoded):  # decode: a new block whenever a request's last one is full
        for r, n in enumerate(prompts):
            if (n + step) % BLOCK == 0:
                tables[r, (n + step) // BLOCK] = next(nxt)
    return tables


def read_speed(nbytes: int, repeats: int) -> float:
    """GB/s of torch.sum over 8 fp32 tensors of `nbytes` each (two threads)."""
    import torch

    ts = [torch.randn(nbytes // 4) for _ in range(LAYERS)]
    for t in ts:
        t.sum()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for t in ts:
            t.sum()
        runs.append(time.perf_counter() - t0)
    return LAYERS * nbytes / sorted(runs)[len(runs) // 2] / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--layouts", default="engine,random")
    ap.add_argument("--decoded", type=int, default=64, help="tokens decoded so far (W64: 0-128)")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    import torch

    from engine.worker.kernels.attention import paged_attention

    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    lens = [rng.randint(32, 256) + args.decoded for _ in range(REQUESTS)]
    pool = sum(-(-n // BLOCK) for n in lens) * 4
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        caches = [torch.randn(pool, 2, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
        q = torch.randn(REQUESTS, HEADS, HEAD_DIM).to(dtype)
        out = torch.empty_like(q)
        rows = torch.arange(REQUESTS)
        pos = torch.tensor([n - 1 for n in lens])
        nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * q.element_size()
        gbs_sum = read_speed(nbytes, args.repeats)
        for layout in args.layouts.split(","):
            tables = block_tables(lens, args.decoded, layout, pool, rng)

            def one_pass(caches=caches, q=q, tables=tables, rows=rows, pos=pos, out=out) -> None:
                for c in caches:
                    paged_attention(q, c, tables, rows, rows, pos, out, HEAD_DIM**-0.5, None)

            for _ in range(3):
                one_pass()
            runs = []
            with LoadMeter() as load:
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    one_pass()
                    runs.append((time.perf_counter() - t0) / LAYERS)
            runs.sort()
            med = runs[len(runs) // 2]
            rec = base_record("paged_attention")
            rec.update(
                dtype=dtype_name, layout=layout, decoded=args.decoded, threads=args.threads,
                shape={"requests": REQUESTS, "heads": HEADS, "kv_heads": KV_HEADS,
                       "head_dim": HEAD_DIM, "block": BLOCK, "layers": LAYERS},
                ms_per_layer=round(med * 1e3, 3), best_ms_per_layer=round(runs[0] * 1e3, 3),
                mb_per_layer=round(nbytes / 1e6, 2), gb_s=round(nbytes / med / 1e9, 1),
                torch_sum_gb_s=round(gbs_sum, 1), of_torch_sum=round(nbytes / med / 1e9 / gbs_sum, 2),
                other_cores=round(load.other_cores, 2),
            )  # fmt: skip
            log(f"{dtype_name:9s} {layout:7s}: {rec['ms_per_layer']:.3f} ms/layer "
                f"(best {rec['best_ms_per_layer']:.3f}), {rec['mb_per_layer']} MB, {rec['gb_s']} GB/s "
                f"= {rec['of_torch_sum']}x torch.sum's {rec['torch_sum_gb_s']} GB/s, "
                f"other cores {rec['other_cores']}")  # fmt: skip
            if not args.no_write:
                write_jsonl(RESULTS_DIR / "paged_attention.jsonl", rec)


if __name__ == "__main__":
    main()
