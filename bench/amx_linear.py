"""bf16 linears on our AMX kernel (csrc/amx_linear.c) against oneDNN's packed GEMM.

Three views, each a side-by-side on this machine (2 threads), one JSON line each in
bench/results/amx_linear.jsonl (`--no-write`: none):

- **kernel**: llama50m's layer shapes and its LM head at `--rows`, weights in cache: the
  median us of the AMX kernel, oneDNN's packed GEMM and F.linear (which re-packs per call).
- **step**: a decode step's 32 layer GEMMs (8 layers x qkv, o, gate/up, down) at 64 rows,
  with 14 MB streamed between layers as the step's attention streams its KV pages (so the
  weights come from memory, as in the engine); the two arms interleaved, medians of
  `--repeats` x 20 steps.
- **w64**: bench/throughput.py's W64 offline workload on llama50m in bf16 through
  `LLM.generate`, `APPLIANCE_AMX_LINEAR=auto` against `off` in alternating subprocesses
  (`--pairs` pairs, each process timing 3 runs after a warm-up), the ratio off/auto per pair.

    python bench/amx_linear.py                        # all three
    python bench/amx_linear.py --parts kernel --rows 1,64,512
    python bench/amx_linear.py --parts w64 --pairs 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, base_record, log, write_jsonl  # noqa: E402

SHAPES = [(1024, 512), (512, 512), (3072, 512), (512, 1536)]  # (N, K): qkv, o, gate/up, down
HEAD = (49152, 512)


def _median_us(fn, n: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def kernel_part(rows: list[int]) -> dict:
    import torch
    import torch.nn.functional as F

    from engine.worker.kernels import amx_linear
    from engine.worker.models.cpu_linear import pack_weight, packed_linear

    table = []
    for m in rows:
        for n, k in [*SHAPES, HEAD]:
            x = torch.randn(m, k).to(torch.bfloat16)
            w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
            tiles, dnn = amx_linear.pack(w), pack_weight(w, amx=False)
            reps = 20 if n * m > 10**7 else 200
            row = {
                "rows": m, "n": n, "k": k,
                "amx_us": _median_us(lambda x=x, t=tiles, n=n: amx_linear.linear(x, t, None, n), reps),
                "onednn_us": _median_us(lambda x=x, d=dnn, n=n: packed_linear(x, d, None, n), reps),
                "f_linear_us": _median_us(lambda x=x, w=w: F.linear(x, w), reps),
            }  # fmt: skip
            table.append(
                {key: round(v, 1) if isinstance(v, float) else v for key, v in row.items()}
            )
            log(f"{m:5d} rows {n:6d}x{k:5d}: amx {row['amx_us']:8.1f} us  oneDNN "
                f"{row['onednn_us']:8.1f}  F.linear {row['f_linear_us']:8.1f}")  # fmt: skip
    return {"part": "kernel", "table": table}


def step_part(repeats: int, rows: int = 64) -> dict:
    import torch

    from engine.worker.kernels import amx_linear
    from engine.worker.models.cpu_linear import pack_weight, packed_linear

    layers = []
    for _ in range(8):
        ws = [(torch.randn(n, k) * 0.05).to(torch.bfloat16) for n, k in SHAPES]
        layers.append([(w.shape[0], amx_linear.pack(w), pack_weight(w, amx=False)) for w in ws])
    kv = torch.randn(8, 7 << 20).to(torch.bfloat16)  # 14 MB a layer
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in SHAPES}

    def step(arm: str) -> float:
        spent = 0.0
        for i, layer in enumerate(layers):
            kv[i].max()  # evicts the caches, as attention does
            t0 = time.perf_counter()
            for (n, tiles, dnn), (_, k) in zip(layer, SHAPES, strict=True):
                if arm == "amx":
                    amx_linear.linear(xs[k], tiles, None, n)
                else:
                    packed_linear(xs[k], dnn, None, n)
            spent += time.perf_counter() - t0
        return spent * 1e3

    ms: dict[str, list[float]] = {"amx": [], "onednn": []}
    for r in range(repeats):
        for arm in ("amx", "onednn") if r % 2 == 0 else ("onednn", "amx"):
            ms[arm].append(statistics.median(step(arm) for _ in range(20)))
    out = {a: round(statistics.median(v), 3) for a, v in ms.items()}
    ratios = [o / a for a, o in zip(ms["amx"], ms["onednn"], strict=True)]
    log(f"step's 32 GEMMs at {rows} rows, weights from memory: amx {out['amx']} ms, oneDNN "
        f"{out['onednn']} ms, oneDNN/amx {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
    return {
        "part": "step", "rows": rows, "repeats": repeats, "ms": out,
        "onednn_over_amx": round(statistics.median(ratios), 3),
        "range": [round(min(ratios), 3), round(max(ratios), 3)],
    }  # fmt: skip


def w64_child(runs: int) -> None:
    from bench.workloads import ensure_model, w64
    from engine import LLM, SamplingParams

    path = ensure_model("llama50m")
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    llm = LLM(str(path), dtype="bfloat16", kv_cache_gib=3.0, max_num_seqs=256,
              max_num_batched_tokens=2048, max_model_len=2048, num_threads=2)  # fmt: skip

    def run(prompts, outs) -> float:
        ps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)
        return time.perf_counter() - t0

    wl = w64(vocab, 0)
    run(wl.prompts[:8], [8] * 8)  # warm-up
    times = [run(wl.prompts, wl.max_tokens) for _ in range(runs)]
    print(json.dumps({"times": times, "tokens": sum(wl.max_tokens)}), flush=True)


def w64_part(pairs: int, runs: int = 3) -> dict:
    meds: dict[str, list[float]] = {"auto": [], "off": []}
    for p in range(pairs):
        for arm in ("auto", "off") if p % 2 == 0 else ("off", "auto"):
            env = dict(os.environ, APPLIANCE_AMX_LINEAR=arm)
            proc = subprocess.run(
                [sys.executable, __file__, "--w64-child", str(runs)], env=env, cwd=ROOT,
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            meds[arm].append(statistics.median(got["times"]))
        log(f"pair {p}: amx {meds['auto'][-1]:.3f} s, oneDNN {meds['off'][-1]:.3f} s")
    ratios = [o / a for a, o in zip(meds["auto"], meds["off"], strict=True)]
    rec = {
        "part": "w64", "pairs": pairs, "runs_per_process": runs,
        "wall_s": {"amx": [round(v, 3) for v in meds["auto"]],
                   "onednn": [round(v, 3) for v in meds["off"]]},
        "onednn_over_amx": round(statistics.median(ratios), 3),
        "range": [round(min(ratios), 3), round(max(ratios), 3)],
        "faster_pairs": sum(r > 1 for r in ratios),
    }  # fmt: skip
    log(f"W64 bf16 wall, oneDNN/amx: median {rec['onednn_over_amx']} {rec['range']}, "
        f"amx faster in {rec['faster_pairs']} of {pairs}")  # fmt: skip
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="kernel,step,w64")
    ap.add_argument("--rows", default="1,4,64,128,512,2048")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--w64-child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.w64_child:
        return w64_child(args.w64_child)
    from engine.worker.kernels import amx_linear

    parts = args.parts.split(",")
    if {"kernel", "step"} & set(parts) and not amx_linear.available():
        raise SystemExit("no AMX tiles on this machine: nothing to compare")
    for part in parts:
        if part == "kernel":
            rec = kernel_part([int(r) for r in args.rows.split(",")])
        elif part == "step":
            rec = step_part(args.repeats)
        elif part == "w64":
            rec = w64_part(args.pairs)
        else:
            raise SystemExit(f"unknown part {part!r}")
        if not args.no_write:
            write_jsonl(RESULTS_DIR / "amx_linear.jsonl", {**base_record("amx_linear"), **rec})


if __name__ == "__main__":
    main()
