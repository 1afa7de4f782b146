"""Model FLOPs utilization of large-batch decode against this machine's measured fp32 GEMM peak.

1. Peak: `torch.matmul` on fp32 matrices with the benchmark's thread count (2), square sizes
   512-3072 plus the decode GEMM shapes of the model at the batch size; each timed for about
   a second after a warm-up, in 3 passes; the peak is the best GFLOP/s seen. (Measured, not the vendor's
   number: on a VM that is what the hardware gives torch.)
2. Decode: our engine (`LLM.generate`) with `--batch` requests of `--prompt-len` random
   tokens and `--output-len` new tokens each, all at once, max_num_seqs = batch. Only
   decode-only steps count (every scheduled request computes one token), timed around
   `LLMEngine.step` as in bench/peers/ours_peer.py.
3. Model FLOPs per decoded token: 2 x the parameters of every matmul the token passes
   through (q/k/v/o, gate/up/down in every layer, lm_head; embeddings are a lookup) plus
   attention, 4 x layers x heads x head_dim x context (QK^T and PV) at the mean context
   of the decode steps. MFU = decode tokens/s x FLOPs/token / peak; reported with and
   without the attention term. Goal (issue 8): >= 50%.

    python bench/mfu.py                      # llama50m and smollm2, batch 256
    python bench/mfu.py --models smollm2 --batch 128 --output-len 64
    python bench/mfu.py --quick              # tiny model, batch 32
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, LoadMeter, base_record, log, versions, write_jsonl  # noqa: E402
from bench.peers.ours_peer import StepSplit  # noqa: E402
from bench.workloads import ensure_model, model_info  # noqa: E402

GOAL = 0.5


def gemm_gflops(m: int, k: int, n: int, seconds: float) -> float:
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    best = 0.0
    t_end = time.perf_counter() + seconds
    while best == 0.0 or time.perf_counter() < t_end:  # best of bursts: robust to other tenants
        it, t0 = 0, time.perf_counter()
        while it < 3 or time.perf_counter() - t0 < seconds / 5:
            torch.matmul(a, b, out=out)
            it += 1
        best = max(best, 2 * m * k * n * it / (time.perf_counter() - t0) / 1e9)
    return best


def measure_peak(
    threads: int, shapes: list[tuple[int, int, int]], seconds: float, rounds: int
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    best: dict[tuple[int, int, int], float] = {}
    with LoadMeter() as meter:
        for _ in range(rounds):  # several passes: a shape hit by a neighbour's burst gets retried
            for m, k, n in shapes:
                g = gemm_gflops(m, k, n, seconds)
                best[(m, k, n)] = max(best.get((m, k, n), 0.0), g)
    rows = [{"m": m, "k": k, "n": n, "gflops": round(g, 2)} for (m, k, n), g in best.items()]
    for r in rows:
        log(f"  matmul {r['m']}x{r['k']} @ {r['k']}x{r['n']}: {r['gflops']:.1f} GFLOP/s")
    top = max(rows, key=lambda r: r["gflops"])
    return {"threads": threads, "rounds": rounds, "seconds_per_shape": seconds,
            "peak_gflops": top["gflops"], "peak_shape": top, "shapes": rows,
            **meter.as_dict()}  # fmt: skip


def matmul_params(info: dict[str, Any]) -> int:
    h, hd = info["hidden_size"], info["head_dim"]
    q, kv = info["num_heads"] * hd, info["num_kv_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * info["intermediate_size"]
    return info["num_layers"] * per_layer + h * info["vocab_size"]


def decode_shapes(info: dict[str, Any], batch: int) -> list[tuple[int, int, int]]:
    h, hd = info["hidden_size"], info["head_dim"]
    q, kv = info["num_heads"] * hd, info["num_kv_heads"] * hd
    inter = info["intermediate_size"]
    return [
        (batch, h, q + 2 * kv),
        (batch, h, 2 * inter),
        (batch, inter, h),
        (batch, h, info["vocab_size"]),
    ]


def measure_decode(path: Path, info: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(
        str(path), dtype="float32", kv_cache_gib=args.kv_gib, max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
        max_model_len=min(2048, info["max_position_embeddings"] or 2048),
    )  # fmt: skip
    rng = random.Random(args.seed)
    lo = 100 if info["vocab_size"] > 400 else 1
    prompts = [
        {
            "prompt_token_ids": [
                rng.randrange(lo, info["vocab_size"]) for _ in range(args.prompt_len)
            ]
        }
        for _ in range(args.batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(
        prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    split = StepSplit(llm.engine)
    if not split.ok:
        raise RuntimeError("cannot time engine steps (LLMEngine.step / scheduler.schedule moved)")
    with LoadMeter() as meter:
        llm.generate(prompts, params, use_tqdm=False)
    s = split.as_dict()
    # Mean context of a decode step: prompt + outputs so far; decode steps run once every
    # request is in, so the context goes from about prompt_len + 1 to prompt_len + output_len.
    mean_ctx = args.prompt_len + (args.output_len + 1) / 2
    return {"threads": torch.get_num_threads(), "batch": args.batch, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "mean_context": mean_ctx, "wall_s": round(meter.wall_s, 2),
            **meter.as_dict(), **s}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="llama50m,smollm2")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--gemm-seconds", type=float, default=1.0, help="time per GEMM shape and pass")
    ap.add_argument("--gemm-rounds", type=int, default=3, help="passes over the GEMM shapes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny model, batch 32, 8 tokens")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "mfu.jsonl")
    args = ap.parse_args()
    if args.quick:
        args.models, args.batch, args.output_len = "tiny", 32, 8
        args.gemm_seconds, args.gemm_rounds = 0.3, 1
    models = [m for m in args.models.split(",") if m]
    infos = {m: (ensure_model(m), None) for m in models}
    infos = {m: (p, model_info(p)) for m, (p, _) in infos.items()}

    shapes = [(s, s, s) for s in ((512, 1024) if args.quick else (512, 1024, 2048, 3072))]
    for _, info in infos.values():
        shapes += [sh for sh in decode_shapes(info, args.batch) if sh not in shapes]
    log(f"fp32 GEMM peak with {args.threads} threads ...")
    peak = measure_peak(args.threads, shapes, args.gemm_seconds, args.gemm_rounds)
    log(f"peak {peak['peak_gflops']} GFLOP/s (other cores {peak['other_cores']})")

    for name, (path, info) in infos.items():
        log(f"{name}: decode batch {args.batch} ...")
        dec = measure_decode(path, info, args)
        p_mm = matmul_params(info)
        flops_mm = 2 * p_mm
        flops_attn = (
            4 * info["num_layers"] * info["num_heads"] * info["head_dim"] * dec["mean_context"]
        )
        tps = dec["decode_tok_s"] or 0.0
        achieved = tps * (flops_mm + flops_attn) / 1e9
        mfu = achieved / peak["peak_gflops"]
        mfu_mm = tps * flops_mm / 1e9 / peak["peak_gflops"]
        # The same decode GEMMs run alone: what the model's shapes allow at this batch.
        shape_best = max((r["gflops"] for r in peak["shapes"]
                          if (r["m"], r["k"], r["n"]) in decode_shapes(info, args.batch)), default=None)  # fmt: skip
        rec = base_record("mfu")
        rec.update({
            "model": name, "model_info": info, "versions": versions(), "gemm": peak,
            "decode": dec, "matmul_params": p_mm, "flops_per_token_matmul": flops_mm,
            "flops_per_token_attention": round(flops_attn), "achieved_gflops": round(achieved, 2),
            "mfu": round(mfu, 4), "mfu_matmul_only": round(mfu_mm, 4),
            "best_decode_shape_gflops": shape_best, "goal": GOAL, "goal_met": mfu >= GOAL,
        })  # fmt: skip
        print(f"{name}: decode {tps} tok/s at batch {dec['mean_decode_batch']} "
              f"({dec['decode_steps']} decode steps, other cores {dec['other_cores']}), "
              f"{(flops_mm + flops_attn) / 1e6:.1f} MFLOP/token -> {achieved:.1f} GFLOP/s = "
              f"{100 * mfu:.1f}% of the {peak['peak_gflops']} GFLOP/s peak "
              f"(matmul-only {100 * mfu_mm:.1f}%; goal >= {100 * GOAL:.0f}%: "
              f"{'met' if mfu >= GOAL else 'NOT met'})")  # fmt: skip
        if not args.no_write:
            write_jsonl(args.out, rec)
    if not args.no_write:
        log(f"appended to {args.out}")


if __name__ == "__main__":
    main()
