"""Many tenants, one appliance, served: fair share under a flood, and deadlines that cost
nothing once passed (issue 31).

`appliance serve` runs as a subprocess (the default model, SmolLM2-135M, fp32; `--quick`:
the tiny test model), with two tenants of equal weight (keys `key-a`, `key-b`) and
tracing exported to an OTLP receiver in this process (bench/span_sink.py), so that every
request's queueing delay, TTFT and deadline expiry are the engine's own timestamps. Every
request is a non-streamed /v1/completions of `--prompt-len` random token ids and
`--output-len` tokens (ignore_eos), sent open-loop at Poisson times for `--duration`
seconds (default: long enough for B to send about 40 requests, 30-180 s); whatever is still
unanswered `--drain-s` after the last arrival is cancelled (counted, never waited for). The
batch is `--max-num-seqs`; the queue bound is `--queue-s` seconds of capacity (at least
twice the batch), so FCFS's wait behind a flood is bounded by the bound, as in production.

1. capacity: requests/s the server completes at saturation (closed loop, 2x the batch), on
   a server of its own.
2. alone: tenant B alone at 20 % of capacity (policy fair).
3. flood: tenant A at 5x capacity and B at 20 %, the same arrival times, under fcfs, fair,
   and fair with scheduler.preempt_for_fairness. B's queueing delay and TTFT p99 (engine
   timestamps, and the same counted in engine steps: the spans' step counts from each
   request's arrival), total throughput (output tokens/s of requests completed),
   preemptions, and the mean engine step during the flood (its wall time over
   `appliance_engine_steps`). Goals, in counted steps: B's queueing p99 <= 2 steps; B's
   TTFT p99 <= alone + 3 steps; FCFS >= 3x worse; throughput fair / fcfs >= 0.97. The
   seconds over the mean step are reported beside them (`*_mean_steps`): one long step,
   such as the flood's first prefill, counts there as several.
4. goodput: A and B together at 2x capacity, each request with a deadline of `--tight-s`
   or `--loose-s` (half each), under `deadline` with the deadline sent as X-Request-Timeout,
   against fcfs without deadline handling (no header; the client judges the same deadline),
   and fcfs with the header (the drops without the earliest-deadline order). Goodput =
   requests finished within their deadline per second; goal >= 1.3x FCFS, and 0 tokens
   computed for requests that expired in the queue (their spans: no step).

Results: one JSON line in bench/results/tenants.jsonl (machine, load, every figure, the
ratios), the per-tenant TTFT-over-time plot bench/results/tenants_ttft.png. The box is
shared: compare the ratios of one invocation, read `other_cores`.

    python bench/tenants.py              # default model, ~15 minutes on 2 cores
    python bench/tenants.py --quick      # tiny model, short runs (smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, LoadMeter, base_record, log, versions, write_jsonl  # noqa: E402
from bench.servers import Server, free_port  # noqa: E402
from bench.span_sink import RequestSpan, SpanSink  # noqa: E402
from bench.tenant_client import (  # noqa: E402
    KEYS,
    VOCAB,
    Plan,
    Sent,
    pct,
    poisson,
    prompts,
    r4,
    send_by_tenant,
)
from bench.workloads import ensure_model, model_info  # noqa: E402

TENANTS_YAML = "{A: {keys: [key-a]}, B: {keys: [key-b]}}"


# ---- the server -----------------------------------------------------------------------------
def start_server(args: argparse.Namespace, sink: SpanSink, policy: str, **extra: Any) -> Server:
    port = free_port()
    sets = {
        "model.path": args.model_dir,
        # 4x the prompt, and always room for prompt + output (--quick: 32 + 128 > 4 x 32).
        "model.max_model_len": max(min(512, args.prompt_len * 4), args.prompt_len + args.output_len),
        "runtime.device": "cpu", "runtime.num_threads": args.threads,
        "scheduler.policy": policy, "scheduler.max_num_seqs": args.max_num_seqs,
        "scheduler.max_queue_len": args.max_queue_len or 4 * args.max_num_seqs,
        "server.host": "127.0.0.1", "server.http_port": port, "server.grpc_port": "null",
        "server.tenants": TENANTS_YAML,
        "telemetry.otlp_endpoint": sink.endpoint, "telemetry.otlp_protocol": "http/protobuf",
        "telemetry.log_level": "warning", **extra,
    }  # fmt: skip
    cmd = [sys.executable, "-m", "appliance", "serve"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads), **omp_wait_env()}
    server = Server(f"tenants-{policy}", cmd, env, port)
    server.wait_healthy(600)
    return server


# OpenMP's waiting at barriers, passed to the server when set here (docs/config.md,
# runtime.num_threads: what spinning costs when the clients share the server's cores).
OMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def omp_wait_env() -> dict[str, str]:
    return {k: os.environ[k] for k in OMP_WAIT_VARS if k in os.environ}


def counter(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and not s.labels:
                return s.value
    return 0.0


# ---- the scenarios --------------------------------------------------------------------------
def capacity(args: argparse.Namespace, url: str, batches: int = 4) -> float:
    """Requests/s completed with 2x max_num_seqs always in flight (`batches` x the batch in
    all; a short call warms a fresh server up)."""
    n, conc = batches * args.max_num_seqs, 2 * args.max_num_seqs
    ps = prompts(n, args.prompt_len, seed=99)

    async def run() -> float:
        queue = list(ps)
        async with httpx.AsyncClient(timeout=600) as client:

            async def worker() -> None:
                while queue:
                    body = {
                        "prompt": queue.pop(),
                        "max_tokens": args.output_len,
                        "ignore_eos": True,
                    }
                    headers = {"Authorization": f"Bearer {KEYS['A']}"}
                    r = await client.post(f"{url}/v1/completions", json=body, headers=headers)
                    r.raise_for_status()

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(conc)))
            return n / (time.perf_counter() - t0)

    return asyncio.run(run())


def flood_plans(args: argparse.Namespace, cap: float, with_a: bool) -> list[Plan]:
    rng = random.Random(args.seed)
    b_times = poisson(0.2 * cap, args.duration, rng)
    a_times = poisson(5.0 * cap, args.duration, rng) if with_a else []
    ps = prompts(len(a_times) + len(b_times), args.prompt_len, args.seed)
    plans = [Plan("A", t, ps[i]) for i, t in enumerate(a_times)]
    plans += [Plan("B", t, ps[len(a_times) + i]) for i, t in enumerate(b_times)]
    return sorted(plans, key=lambda p: p.at)


def goodput_plans(args: argparse.Namespace, cap: float, send_timeout: bool) -> list[Plan]:
    rng = random.Random(args.seed + 1)
    plans = []
    for tenant, share in (("A", 1.5), ("B", 0.5)):
        for t in poisson(share * cap, args.duration, rng):
            d = args.tight_s if rng.random() < 0.5 else args.loose_s
            plans.append(Plan(tenant, t, [], d, send_timeout))
    ps = prompts(len(plans), args.prompt_len, args.seed + 1)
    for p, prompt in zip(plans, ps, strict=True):
        p.prompt = prompt
    return sorted(plans, key=lambda p: p.at)


def run_load(
    args: argparse.Namespace, server: Server, sink: SpanSink, plans: list[Plan]
) -> tuple[list[Sent], dict[str, RequestSpan], dict[str, Any]]:
    """Sends `plans`; waits for the spans; the engine's steps and preemptions meanwhile."""
    sink.take()
    steps0 = counter(server.url, "appliance_engine_steps_total")
    pre0 = counter(server.url, "appliance_preemptions_total")
    gen0 = counter(server.url, "appliance_generation_tokens_total")
    t0 = time.perf_counter()
    with LoadMeter() as load:
        sent = send_by_tenant(server.url, plans, args.output_len, args.drain_s)
    wall = time.perf_counter() - t0
    steps = counter(server.url, "appliance_engine_steps_total") - steps0
    preemptions = counter(server.url, "appliance_preemptions_total") - pre0
    generated = counter(server.url, "appliance_generation_tokens_total") - gen0
    want = {s.request_id for s in sent if s.request_id}
    deadline = time.monotonic() + 30  # the batch span processor exports every 5 s
    spans: dict[str, RequestSpan] = {}
    while time.monotonic() < deadline:
        spans.update(sink.take())
        if want <= set(spans):
            break
        time.sleep(0.5)
    info = {
        "wall_s": round(wall, 2),
        "engine_steps": int(steps),
        "mean_step_ms": round(wall / steps * 1000, 2) if steps else None,
        "preemptions": int(preemptions),
        # Tokens the engine generated per step: batch efficiency, which other processes'
        # load does not move (unlike tokens/s).
        "generated_tokens_per_step": round(generated / steps, 3) if steps else None,
        "load": load.as_dict(),
    }
    return sent, spans, info


def tenant_figures(
    sent: list[Sent], spans: dict[str, RequestSpan], tenant: str, wall: float
) -> dict:
    mine = [s for s in sent if s.tenant == tenant]
    ok = [s for s in mine if s.ok]
    sp = [spans[s.request_id] for s in ok if s.request_id in spans]
    return {
        "sent": len(mine),
        "ok": len(ok),
        "refused_429": sum(s.status == 429 for s in mine),
        "cancelled_unanswered": sum(s.status == -2 for s in mine),
        "other_errors": sum(s.status not in (200, 429, -2) for s in mine),
        "spans": len(sp),
        "queue_p50_s": r4(pct([x.queue_s for x in sp], 50)),
        "queue_p99_s": r4(pct([x.queue_s for x in sp], 99)),
        "ttft_p50_s": r4(pct([x.ttft_s for x in sp], 50)),
        "ttft_p99_s": r4(pct([x.ttft_s for x in sp], 99)),
        # The same, counted in engine steps (the request span's step counts).
        "queue_steps_p50": pct([x.queue_steps for x in sp], 50),
        "queue_steps_p99": pct([x.queue_steps for x in sp], 99),
        "ttft_steps_p99": pct([x.ttft_steps for x in sp], 99),
        "client_e2e_p99_s": r4(pct([s.e2e for s in ok], 99)),
        # Client send -> the server's arrival stamp: time in the client and the HTTP layer,
        # before the engine's queue (the box's load shows here first).
        "send_to_arrival_p99_s": r4(
            pct([spans[s.request_id].start - s.sent_epoch for s in ok if s.request_id in spans], 99)
        ),
        "output_tok_per_s": round(sum(s.tokens for s in ok) / wall, 2),
    }


def flood_run(args, server, sink, plans) -> tuple[dict, list[tuple[str, float, float]]]:
    sent, spans, info = run_load(args, server, sink, plans)
    wall = info["wall_s"]
    out = {
        **info,
        "A": tenant_figures(sent, spans, "A", wall),
        "B": tenant_figures(sent, spans, "B", wall),
    }
    out["total_output_tok_per_s"] = round(
        out["A"]["output_tok_per_s"] + out["B"]["output_tok_per_s"], 2
    )
    # Only this run's requests (a warm-up's spans may arrive late, in the same export).
    mine = [spans[s.request_id] for s in sent if s.request_id in spans]
    t_min = min((x.start for x in mine), default=0.0)
    points = [(x.tenant, x.start - t_min, x.ttft_s) for x in mine if x.ttft_s is not None]
    return out, points


def goodput_run(args, server, sink, plans) -> dict:
    sent, spans, info = run_load(args, server, sink, plans)
    good = [s for s in sent if s.ok and s.deadline_s is not None and s.e2e <= s.deadline_s]
    expired_queue = [x for x in spans.values() if x.expired == "queue"]
    expired_running = [x for x in spans.values() if x.expired == "running"]
    return {
        **info,
        "sent": len(sent),
        "ok": sum(s.ok for s in sent),
        "status_504": sum(s.status == 504 for s in sent),
        "cancelled_unanswered": sum(s.status == -2 for s in sent),
        "refused_429": sum(s.status == 429 for s in sent),
        "within_deadline": len(good),
        "goodput_req_per_s": round(len(good) / info["wall_s"], 3),
        "expired_in_queue": len(expired_queue),
        "expired_running": len(expired_running),
        # Nothing computed for a request that expired in the queue: never scheduled, no token.
        "expired_in_queue_scheduled_or_tokens": sum(
            x.scheduled or x.output_tokens > 0 for x in expired_queue
        ),
    }


# ---- the plot -------------------------------------------------------------------------------
def plot(runs: dict[str, list[tuple[str, float, float]]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), sharey=True)
    for ax, (name, points) in zip(axes, runs.items(), strict=True):
        for tenant, color in (("A", "tab:red"), ("B", "tab:blue")):
            xs = [t for who, t, _ in points if who == tenant]
            ys = [v for who, _, v in points if who == tenant]
            label = "A (5x capacity)" if tenant == "A" else "B (20 %)"
            ax.scatter(xs, ys, s=6 if tenant == "A" else 14, c=color, label=label, alpha=0.6)
        ax.set_title(name)
        ax.set_xlabel("arrival (s from the first request)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("TTFT (s, engine timestamps)")
    axes[0].legend(loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="tiny, smollm2, ... or a directory")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per run")
    ap.add_argument("--drain-s", type=float, default=None, help="default: 2x --queue-s")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--queue-s", type=float, default=8.0, help="queue bound, s of capacity")
    ap.add_argument("--max-queue-len", type=int, default=None, help="overrides --queue-s")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tight-s", type=float, default=None, help="default: 4x B's e2e alone")
    ap.add_argument("--loose-s", type=float, default=None, help="default: 12x B's e2e alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity", type=float, default=None, help="req/s: skip measuring it")
    ap.add_argument(
        "--goodput-only", action="store_true",
        help="only the goodput runs (with --capacity, --tight-s and --loose-s from a full run)",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="tiny model, 15 s runs, 128 tokens")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.quick:  # longer outputs: the tiny model's steps are short, keep HTTP off the path
        args.model, args.duration = "tiny", args.duration or 15.0
        args.prompt_len, args.output_len = 32, 128
    args.model_dir = str(ensure_model(args.model))
    vocab = model_info(Path(args.model_dir))["vocab_size"]
    VOCAB[:] = [min(1000, vocab // 4), min(40000, vocab - 1)]
    sink = SpanSink()
    record: dict[str, Any] = {
        **base_record("tenants"),
        "versions": versions(),
        "settings": {k: v for k, v in vars(args).items() if k != "model_dir"},
        "omp_wait_env": omp_wait_env(),
    }
    points: dict[str, list] = {}
    try:
        if args.capacity:
            cap = args.capacity
        else:
            log("capacity")
            server = start_server(args, sink, "fcfs")
            try:
                capacity(args, server.url, batches=1)  # warm-up (first steps, kernels)
                cap = capacity(args, server.url)
            finally:
                server.stop()
        record["capacity_req_per_s"] = round(cap, 3)
        args.max_queue_len = args.max_queue_len or max(
            2 * args.max_num_seqs, round(cap * args.queue_s)
        )
        args.duration = args.duration or min(180.0, max(30.0, 40 / (0.2 * cap)))
        args.drain_s = args.drain_s if args.drain_s is not None else 2 * args.queue_s
        record["settings"].update(
            max_queue_len=args.max_queue_len, duration=round(args.duration, 1), drain_s=args.drain_s
        )
        log(f"capacity {cap:.2f} req/s; queue {args.max_queue_len}, {args.duration:.0f} s runs")
        if args.goodput_only:
            if not (args.tight_s and args.loose_s):
                ap.error("--goodput-only needs --tight-s and --loose-s (a full run's)")
            goodput_runs(args, sink, cap, record)
            return finish(args, record, points)
        log("fcfs server: B alone, the flood under fcfs, goodput without deadlines")
        server = start_server(args, sink, "fcfs")
        try:
            capacity(args, server.url, batches=1)  # warm-up
            alone_fcfs, _ = flood_run(args, server, sink, flood_plans(args, cap, with_a=False))
            record["alone_fcfs"] = alone_fcfs
            b_alone_e2e = alone_fcfs["B"]["client_e2e_p99_s"] or 1.0
            args.tight_s = args.tight_s or round(4 * b_alone_e2e, 2)
            args.loose_s = args.loose_s or round(12 * b_alone_e2e, 2)
            record["settings"].update(tight_s=args.tight_s, loose_s=args.loose_s)
            record["flood_fcfs"], points["fcfs"] = flood_run(
                args, server, sink, flood_plans(args, cap, with_a=True)
            )
            log(f"flood fcfs: B {record['flood_fcfs']['B']}")
        finally:
            server.stop()
        log("fair server without preempt_for_fairness: B alone, the flood")
        server = start_server(args, sink, "fair", **{"scheduler.preempt_for_fairness": "false"})
        try:
            capacity(args, server.url, batches=1)  # warm-up
            record["alone_fair"], _ = flood_run(args, server, sink, flood_plans(args, cap, False))
            record["flood_fair"], points["fair"] = flood_run(
                args, server, sink, flood_plans(args, cap, with_a=True)
            )
            log(f"flood fair: B {record['flood_fair']['B']}")
        finally:
            server.stop()
        log("fair server with preempt_for_fairness: the flood")
        server = start_server(args, sink, "fair", **{"scheduler.preempt_for_fairness": "true"})
        try:
            capacity(args, server.url, batches=1)  # warm-up
            record["flood_fair_preempt"], points["fair + preempt_for_fairness"] = flood_run(
                args, server, sink, flood_plans(args, cap, with_a=True)
            )
        finally:
            server.stop()
        goodput_runs(args, sink, cap, record)
    finally:
        sink.close()
    finish(args, record, points)


def goodput_runs(args: argparse.Namespace, sink: SpanSink, cap: float, record: dict) -> None:
    """The same arrivals and deadlines three times: fcfs without deadline handling (no
    header; the client judges), fcfs with the deadlines sent (drops before compute, arrival
    order), deadline (drops, earliest deadline first)."""
    arms = (("goodput_fcfs", "fcfs", False), ("goodput_fcfs_deadlines", "fcfs", True),
            ("goodput_deadline", "deadline", True))  # fmt: skip
    for name, policy, send in arms:
        log(f"{policy} server: goodput, deadlines {'sent' if send else 'not sent'}")
        server = start_server(args, sink, policy)
        try:
            capacity(args, server.url, batches=1)  # warm-up
            record[name] = goodput_run(args, server, sink, goodput_plans(args, cap, send))
            log(f"{name}: {record[name]}")
        finally:
            server.stop()


def finish(args: argparse.Namespace, record: dict, points: dict) -> None:
    record["goals"] = goals(record)
    print(json.dumps(record["goals"], indent=2))
    if not args.no_write:
        write_jsonl(RESULTS_DIR / "tenants.jsonl", record)
        log("appended to bench/results/tenants.jsonl")
        if points:
            title = (f"{args.model}, A at 5x capacity ({record['capacity_req_per_s']} req/s), "
                     f"B at 20 %, {record['date'][:16]}")  # fmt: skip
            plot(points, RESULTS_DIR / "tenants_ttft.png", title)
            log("plot bench/results/tenants_ttft.png")


def goals(r: dict) -> dict:
    """The issue's goals, each as the figure, the bar and whether it was met."""
    out: dict[str, Any] = {}
    for name in ("flood_fair", "flood_fair_preempt", "flood_fcfs"):
        if name not in r:
            continue
        run = r[name]
        step = (run["mean_step_ms"] or 0) / 1000
        b = run["B"]
        alone = r["alone_fair"]["B"]["ttft_p99_s"] or 0.0
        alone_steps = r["alone_fair"]["B"].get("ttft_steps_p99")
        out[name] = {
            "mean_step_s": r4(step),
            # The goals' unit: engine steps counted from each request's arrival.
            "B_queue_p99_steps": b.get("queue_steps_p99"),
            "B_ttft_p99_minus_alone_steps": b["ttft_steps_p99"] - alone_steps
            if b.get("ttft_steps_p99") is not None and alone_steps is not None else None,
            # The seconds over the flood's mean step (a long step counts as several).
            "B_queue_p99_mean_steps": round(b["queue_p99_s"] / step, 2) if step and b["queue_p99_s"] is not None else None,
            "B_ttft_p99_s": b["ttft_p99_s"],
            "B_ttft_p99_alone_s": alone,
            "B_ttft_p99_minus_alone_mean_steps": round((b["ttft_p99_s"] - alone) / step, 2)
            if step and b["ttft_p99_s"] is not None else None,
            "throughput_over_fcfs": round(
                run["total_output_tok_per_s"] / r["flood_fcfs"]["total_output_tok_per_s"], 3
            ),
            "tokens_per_step_over_fcfs": round(
                run["generated_tokens_per_step"] / r["flood_fcfs"]["generated_tokens_per_step"], 3
            ),
            "preemptions": run["preemptions"],
        }  # fmt: skip
    if "flood_fair" in r:
        fair, fcfs = r["flood_fair"]["B"], r["flood_fcfs"]["B"]
        if fair["ttft_p99_s"] and fcfs["ttft_p99_s"]:
            out["B_ttft_p99_fcfs_over_fair"] = round(fcfs["ttft_p99_s"] / fair["ttft_p99_s"], 2)
    gd, gf = r["goodput_deadline"], r["goodput_fcfs"]
    for name in ("goodput_deadline", "goodput_fcfs_deadlines"):
        out[f"{name}_over_fcfs"] = (
            round(r[name]["goodput_req_per_s"] / gf["goodput_req_per_s"], 2)
            if gf["goodput_req_per_s"]
            else None
        )
    out["expired_in_queue"] = gd["expired_in_queue"]
    out["expired_in_queue_with_compute"] = gd["expired_in_queue_scheduled_or_tokens"]
    return out


if __name__ == "__main__":
    main()
