"""Replicas behind vllm-router: throughput of 1 vs 2 replicas, and where a conversation lands.

Starts `appliance serve` replicas (HTTP only, `runtime.num_threads` each, default 1) and
vllm-router in front of them with the flags docs/scaling.md gives (`tests.support.router`),
then streams `/v1/completions` from concurrent clients (bench/serving.py's load generator)
in three set-ups, in one invocation so their ratios share the machine's conditions:

- `direct-1`: one replica, no router (the baseline);
- `router-1`: the same replica behind the router (the router's own cost);
- `router-2`: two replicas behind the router (data-parallel scale-out).

Then, on the two replicas, a conversation of `--turns` chat turns through the router, and
each replica's prefix-cache counters (`appliance_prefix_cache_{queries,hits}_total`).

    python bench/router_replicas.py --tiny                 # tiny random model, seconds
    python bench/router_replicas.py -n 64 --concurrency 16 # default model (SmolLM2-135M)

Rows are appended to bench/results/router_replicas.jsonl with the CPU other processes used
during each run (`other_cores`): on a shared 2-core box two 1-thread replicas can at best
double one, and only when nothing else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import LoadMeter, base_record, write_jsonl  # noqa: E402
from bench.serving import run_level, start_server  # noqa: E402
from bench.serving_stats import BRIEF_KEYS, summarize  # noqa: E402
from tests.support.router import start_router  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "router_replicas.jsonl"
SYSTEM = "You are a helpful assistant. Answer every question about the garden briefly."


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("appliance_prefix_cache_queries_total", "appliance_prefix_cache_hits_total"):
            out[name.removeprefix("appliance_prefix_cache_").removesuffix("_total")] = float(value)
    return out


def _conversation(router_url: str, turns: int) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Tell me about flower number {t}."})
        r = httpx.post(
            f"{router_url}/v1/chat/completions",
            json={"messages": messages, "max_tokens": 8, "temperature": 0},
            timeout=600,
        )
        r.raise_for_status()
        messages.append(
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="runtime.num_threads per replica")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("-n", "--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    sets = [f"runtime.num_threads={args.threads}", *args.sets]
    if args.tiny:
        from tests.support.tiny_models import make_tiny_checkpoint

        tiny = make_tiny_checkpoint(tmp / "tiny", "llama")
        sets = [f"model.path={tiny}", "runtime.device=cpu", "model.max_model_len=256", *sets]
    meta = {**base_record("router_replicas"), "sets": sets, "concurrency": args.concurrency,
            "num_requests": args.num_requests, "max_tokens": args.max_tokens}  # fmt: skip

    def measure(mode: str, url: str) -> None:
        with LoadMeter() as load:
            samples, wall = asyncio.run(
                run_level(url, args.concurrency, args.num_requests, args.max_tokens)
            )
        row = {**meta, "mode": mode, **summarize(samples, wall), **load.as_dict()}
        write_jsonl(args.out, row)
        print(json.dumps({"mode": mode, **{k: row[k] for k in BRIEF_KEYS}, **load.as_dict()}))

    servers = [start_server(sets, None) for _ in range(2)]
    router = None
    try:
        (_, url0), (_, url1) = servers
        measure("direct-1", url0)
        router = start_router([url0], tmp / "router1.log")
        measure("router-1", router.url)
        router.stop()
        router = start_router([url0, url1], tmp / "router2.log")
        measure("router-2", router.url)
        before = [_counters(u) for u in (url0, url1)]
        _conversation(router.url, args.turns)
        after = [_counters(u) for u in (url0, url1)]
        delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
        row = {**meta, "mode": "conversation", "turns": args.turns, "per_replica": delta}
        write_jsonl(args.out, row)
        print(json.dumps({"mode": "conversation", "turns": args.turns, "per_replica": delta}))
    finally:
        if router is not None:
            router.stop()
        for proc, _ in servers:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
