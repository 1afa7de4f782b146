"""TTFT with and without prefix caching on the shared-prefix workload (ours only).

Workload (bench/workloads.py `shared-prefix`): one 1,024-token system prompt shared by 32
requests, each followed by its own 16-64 random tokens; 16 output tokens, greedy, ignore EOS.
The same requests run through two engines that differ only in `enable_prefix_caching`, each
in its own subprocess (this script re-invoked with --child), 2 threads, fp32:

- burst: all 32 requests submitted at once; a request's TTFT is the time from submission to
  the end of the engine step that produced its first token. Mean and p50/p90 over requests.
- sequential: one request at a time, each after the previous finished (TTFT of an idle
  engine: with caching on, every request after the first only prefills its own suffix).

Each repeat uses a fresh system prompt (seed + repeat), so no repeat is served from an
earlier repeat's cache. The engine's prefix-hit counters are recorded as a check. Goal
(issue 8): mean TTFT >= 5x lower with caching on; the speed-up is reported for both modes.

    python bench/prefix_ttft.py                 # llama50m, 1 repeat
    python bench/prefix_ttft.py --model smollm2 --repeats 3
    python bench/prefix_ttft.py --quick         # tiny model, 8 requests, 256-token prefix
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    LoadMeter,
    base_record,
    log,
    median,
    rnd,
    versions,
    write_jsonl,
)
from bench.workloads import ensure_model, model_info, shared_prefix  # noqa: E402

GOAL = 5.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def ttft_stats(ttfts: list[float]) -> dict[str, float]:
    return {
        "mean_ms": round(1000 * statistics.mean(ttfts), 1),
        "p50_ms": round(1000 * pct(ttfts, 50), 1),
        "p90_ms": round(1000 * pct(ttfts, 90), 1),
        "max_ms": round(1000 * max(ttfts), 1),
    }


def run_requests(eng: Any, prompts: list[list[int]], params: Any, tag: str) -> list[float]:
    """Submit all, step to completion; TTFT per request (seconds), in input order."""
    t_sub: dict[str, float] = {}
    ttft: dict[str, float] = {}
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        t_sub[rid] = time.perf_counter()
        eng.add_request(rid, {"prompt_token_ids": p}, params)
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in ttft and o.outputs and len(o.outputs[0].token_ids) > 0:
                ttft[o.request_id] = now - t_sub[o.request_id]
    return [ttft[f"{tag}-{i}"] for i in range(len(prompts))]


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    llm = LLM(
        spec["model"], dtype="float32", kv_cache_gib=spec["kv_gib"], num_threads=spec["threads"],
        max_num_seqs=256, max_num_batched_tokens=spec["max_num_batched_tokens"],
        enable_prefix_caching=spec["prefix_caching"], max_model_len=spec["max_model_len"],
    )  # fmt: skip
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=spec["output_len"], ignore_eos=True)
    warm = [list(range(200, 232)), list(range(300, 340))]
    run_requests(eng, warm, params, "warm")
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "repeats": []}
    for r, prompts in enumerate(spec["prompt_sets"]):
        rep: dict[str, Any] = {}
        for mode in spec["modes"]:
            s0 = eng.stats()
            with LoadMeter() as m:
                if mode == "burst":
                    ttfts = run_requests(eng, prompts, params, f"b{r}")
                else:
                    ttfts = []
                    for i, p in enumerate(prompts):
                        ttfts += run_requests(eng, [p], params, f"s{r}-{i}")
            s1 = eng.stats()
            rep[mode] = {
                **ttft_stats(ttfts), "wall_s": round(m.wall_s, 3), **m.as_dict(),
                "prefix_hit_tokens": s1.prefix_cache_hits - s0.prefix_cache_hits,
                "prefix_query_tokens": s1.prefix_cache_queries - s0.prefix_cache_queries,
            }  # fmt: skip
            print(f"caching={spec['prefix_caching']} repeat {r} {mode}: mean TTFT "
                  f"{rep[mode]['mean_ms']} ms, other cores {m.other_cores:.2f}",
                  file=sys.stderr, flush=True)  # fmt: skip
            if mode == "burst" and "sequential" in spec["modes"]:
                # Start sequential mode cold too: drop what burst mode left in the cache.
                eng.kv_manager.reset_prefix_cache()
        out["repeats"].append(rep)
    return out


def run_child(spec: dict[str, Any], timeout: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="prefix-ttft-") as tmp:
        sp, op = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        sp.write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run(
            [sys.executable, __file__, "--child", str(sp), str(op)], env=env, timeout=timeout,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
        )  # fmt: skip
        for line in proc.stdout.splitlines():
            if " repeat " in line:
                print("    " + line, file=sys.stderr)
        if not op.exists():
            return {"ok": False, "error": f"rc {proc.returncode}", "log_tail": proc.stdout[-4000:]}
        return json.loads(op.read_text())


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        spec = json.loads(Path(sys.argv[2]).read_text())
        try:
            res = {"ok": True, **child(spec)}
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            import traceback

            res = {"ok": False, "error": f"{exc}\n{traceback.format_exc()[-4000:]}"}
        Path(sys.argv[3]).write_text(json.dumps(res))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama50m", help="tiny, llama50m, smollm2 or a dir")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--modes", default="burst,sequential", help="comma list of burst, sequential")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 requests, 256-token prefix")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "prefix_ttft.jsonl")
    args = ap.parse_args()
    if args.quick:
        args.model, args.requests, args.prefix_len = "tiny", 8, 256
    modes = [m for m in args.modes.split(",") if m]
    path = ensure_model(args.model)
    info = model_info(path)
    sets = [
        shared_prefix(info["vocab_size"], args.seed + r, num_requests=args.requests,
                      prefix_len=args.prefix_len, output_len=args.output_len).prompts
        for r in range(args.repeats)
    ]  # fmt: skip
    max_len = min(2048, info["max_position_embeddings"] or 2048)
    results = {}
    for caching in (False, True):
        log(f"prefix caching {'on' if caching else 'off'} ({args.model}) ...")
        spec = {
            "model": str(path), "threads": args.threads, "kv_gib": args.kv_gib,
            "max_num_batched_tokens": args.max_num_batched_tokens, "prefix_caching": caching,
            "max_model_len": max_len, "output_len": args.output_len, "prompt_sets": sets,
            "modes": modes,
        }  # fmt: skip
        results["on" if caching else "off"] = run_child(spec, args.timeout)
    rec = base_record("prefix_ttft")
    rec.update({
        "model": args.model, "model_info": info, "versions": versions(),
        "workload": {"requests": args.requests, "prefix_len": args.prefix_len,
                     "suffix_len": "16-64", "output_len": args.output_len, "repeats": args.repeats},
        "settings": {"threads": args.threads, "kv_gib": args.kv_gib,
                     "max_num_batched_tokens": args.max_num_batched_tokens},
    })  # fmt: skip
    summary: dict[str, Any] = {}
    for mode in modes:
        row: dict[str, Any] = {}
        for key in ("off", "on"):
            res = results[key]
            if not res.get("ok"):
                row[key] = {"error": res.get("error")}
                continue
            reps = [rep[mode] for rep in res["repeats"]]
            row[key] = {
                "mean_ms": rnd(median(x["mean_ms"] for x in reps), 1),
                "p50_ms": rnd(median(x["p50_ms"] for x in reps), 1),
                "p90_ms": rnd(median(x["p90_ms"] for x in reps), 1),
                "mean_ms_all": [x["mean_ms"] for x in reps],
                "other_cores_all": [x["other_cores"] for x in reps],
                "prefix_hit_tokens": reps[0]["prefix_hit_tokens"],
                "prefix_query_tokens": reps[0]["prefix_query_tokens"],
            }
        if "mean_ms" in row.get("off", {}) and "mean_ms" in row.get("on", {}):
            sp = row["off"]["mean_ms"] / max(row["on"]["mean_ms"], 1e-9)
            row["speedup"] = round(sp, 2)
            row["goal_met"] = sp >= GOAL
        summary[mode] = row
    rec["ttft"] = summary
    rec["raw"] = results
    for mode, row in summary.items():
        off, on = row.get("off", {}), row.get("on", {})
        if "speedup" in row:
            print(f"{mode:<10} mean TTFT caching off {off['mean_ms']} ms (other cores "
                  f"{off['other_cores_all']}), on {on['mean_ms']} ms (other cores "
                  f"{on['other_cores_all']}; {on['prefix_hit_tokens']} of "
                  f"{on['prefix_query_tokens']} prompt tokens hit) -> {row['speedup']}x "
                  f"(goal >= {GOAL}x: {'met' if row['goal_met'] else 'NOT met'})")  # fmt: skip
        else:
            print(f"{mode:<10} FAILED: off={off.get('error', 'ok')} on={on.get('error', 'ok')}")
    if not args.no_write:
        write_jsonl(args.out, rec)
        log(f"appended to {args.out}")


if __name__ == "__main__":
    main()
