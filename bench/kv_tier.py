"""KV disk tier, served: returning-turn TTFT with and without the tier, page-cache-warm and
cold reads, a restart warm vs cold, throughput when nothing is reused, and vLLM CPU with its
own KV offloading on the same workload where it starts (issue 30; docs/kv_tiers.md).

Workload (multi-turn, Poisson): `--conversations` conversations of `--turns` turns on one
shared `--system`-token system prompt (or `--system-prompts` distinct ones, conversation i
on number i mod their count). A turn's prompt is the system prompt, every earlier
turn (its user tokens and `--answer` assistant tokens) and `--user` new tokens; it asks for
`--answer` tokens (greedy, ignore EOS). Conversations start at Poisson times (`--rate` per
second) and wait an exponential think time (`--think` s mean) between turns. TTFT is read
from the stream (first chunk with text). "Returning" turns are turns 2.. of a conversation.

The KV pool holds `--pool-fraction` of the working set (system prompt plus every
conversation's whole history), never less than one request at `--max-model-len`. Configs,
each one server of ours (`appliance serve`, fp32, `--threads` threads), side by side:

- `no_tier`: the pool alone (the baseline; the same memory budget: the disk tier takes no
  RAM of ours, only page cache, which the cold case removes);
- `disk_warm`: pool + disk tier, buffered reads (on this box the files stay in page cache);
- `disk_cold`: pool + disk tier read with O_DIRECT (`cache.disk_tier_direct_io`), so every
  load comes from the device;
- `restart`: first turns on a server with the tier, SIGTERM (the drain flushes), a new
  server on the same directory answers each conversation's second turn: warm; the same on a
  fresh directory: cold. First returning turn TTFT, warm vs cold;
- `no_reuse`: unique prompts (no shared prefix, one turn), tier on vs off: output tokens/s;
- `vllm_offload`: vLLM CPU (bench/peers/setup_vllm.py's venv) with
  `--kv-offloading-backend native --kv-offloading-size N` on the same multi-turn workload;
  whether it starts and what it said are recorded either way.

    python bench/kv_tier.py                           # the issue's workload (long: ~1 h here)
    python bench/kv_tier.py --conversations 8 --turns 3 --system 1024 --quick-label prelim
    python bench/kv_tier.py --configs no_tier,disk_warm   # a subset

Results: bench/results/kv_tier.jsonl (one record per config and repeat, with the CPU, its
ISA and how many cores other processes kept busy during each run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    CACHE_DIR,
    RESULTS_DIR,
    LoadMeter,
    base_record,
    log,
    rnd,
    versions,
    write_jsonl,
)
from bench.servers import (  # noqa: E402
    SERVED_NAME,
    Server,
    ServerSettings,
    free_port,
    ours_command,
    vllm_command,  # noqa: E402
)
from bench.workloads import ensure_model, model_info  # noqa: E402

OUT = RESULTS_DIR / "kv_tier.jsonl"
VOCAB_LO, VOCAB_HI = 100, 40000  # token ids drawn for synthetic text (SmolLM2: 49,152)
GOALS = {"returning_ttft_speedup": 3.0, "restart_ttft_speedup": 5.0, "no_reuse_ratio": 1.0}


# ---- the workload ------------------------------------------------------------------------------


def conversations(
    args: argparse.Namespace, seed: int
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(the `--system-prompts` system prompts, conversation i using number i mod their
    count; per conversation per turn: the turn's new user+assistant tokens)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(args.system)]
               for _ in range(args.system_prompts)]  # fmt: skip
    convs = []
    for _ in range(args.conversations):
        turns = []
        for _ in range(args.turns):
            user = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(args.user)]
            answer = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(args.answer)]
            turns.append([user, answer])
        convs.append(turns)
    return systems, convs


def turn_prompt(system: list[int], turns: list[list[list[int]]], k: int) -> list[int]:
    """Turn k's prompt: the system prompt, turns 0..k-1 whole, turn k's user tokens."""
    out = list(system)
    for user, answer in turns[:k]:
        out += user + answer
    return out + turns[k][0]


def working_set_tokens(args: argparse.Namespace) -> int:
    systems = min(args.system_prompts, args.conversations)
    return systems * args.system + args.conversations * args.turns * (args.user + args.answer)


async def one_request(client: Any, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, cached, n = None, None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
                n = usage.get("completion_tokens", 0)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "cached": cached, "tokens": n}


async def run_multi_turn(url: str, args: argparse.Namespace, seed: int, turns: range) -> list[dict]:
    """Every conversation's turns in `turns`, conversations overlapping (Poisson)."""
    import httpx

    systems, convs = conversations(args, seed)
    rng = random.Random(seed + 1)
    out: list[dict] = []

    async def conversation(i: int, start: float, client: Any) -> None:
        await asyncio.sleep(start)
        for k in turns:
            prompt = turn_prompt(systems[i % len(systems)], convs[i], k)
            res = await one_request(client, url, prompt, args.answer)
            out.append({"conv": i, "turn": k, **res})
            if k != turns[-1]:
                await asyncio.sleep(rng.expovariate(1.0 / args.think) if args.think else 0)

    starts, t = [], 0.0
    for _ in convs:
        starts.append(t)
        t += rng.expovariate(args.rate)
    async with httpx.AsyncClient(timeout=None) as client:
        await asyncio.gather(*(conversation(i, s, client) for i, s in enumerate(starts)))
    return out


async def run_unique(url: str, args: argparse.Namespace, seed: int) -> dict:
    """`--unique` distinct prompts of system+user length, 4 at a time: tokens/s."""
    import httpx

    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(args.system // 2)]
               for _ in range(args.unique)]  # fmt: skip
    sem = asyncio.Semaphore(4)
    results = []

    async def one(p: list[int], client: Any) -> None:
        async with sem:
            results.append(await one_request(client, url, p, args.answer * 2))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=None) as client:
        await asyncio.gather(*(one(p, client) for p in prompts))
    wall = time.perf_counter() - t0
    return {
        "wall_s": round(wall, 2),
        "output_tok_s": round(sum(r["tokens"] for r in results) / wall, 1),
    }


def summarize(results: list[dict]) -> dict:
    returning = [r["ttft"] for r in results if r["turn"] > 0 and r["ttft"] is not None]
    first = [r["ttft"] for r in results if r["turn"] == 0 and r["ttft"] is not None]
    return {
        "requests": len(results),
        "returning_ttft_p50_s": rnd(statistics.median(returning), 4) if returning else None,
        "returning_ttft_mean_s": rnd(statistics.fmean(returning), 4) if returning else None,
        "first_turn_ttft_p50_s": rnd(statistics.median(first), 4) if first else None,
        "returning_cached_tokens_mean": rnd(statistics.fmean(
            [r["cached"] or 0 for r in results if r["turn"] > 0]), 1) if returning else None,
    }  # fmt: skip


# ---- servers -----------------------------------------------------------------------------------


def settings(args: argparse.Namespace, model: Path) -> ServerSettings:
    return ServerSettings(model=str(model), dtype="float32", kv_cache_gib=1, threads=args.threads,
                          max_num_seqs=32, max_num_batched_tokens=args.batch_tokens,
                          max_model_len=args.max_model_len)  # fmt: skip


def ours(args, model: Path, pool_blocks: int, tier: Path | None, **extra: Any) -> Server:
    port = free_port()
    cmd, env = ours_command(settings(args, model), port)
    sets = {"cache.num_kv_blocks": pool_blocks, "cache.block_size": 16,
            "server.shutdown_grace_s": 60, "telemetry.log_format": "json", **extra}  # fmt: skip
    if tier is not None:
        sets.update({"cache.disk_tier_dir": str(tier), "cache.disk_tier_gib": args.tier_gib})
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    s = Server("ours", cmd, env, port)
    s.wait_healthy(600)
    return s


def pool_blocks_for(args: argparse.Namespace) -> int:
    want = -(-int(working_set_tokens(args) * args.pool_fraction) // 16)
    return max(want, -(-args.max_model_len // 16) + 2)


def measure(name: str, fn, *a) -> tuple[Any, dict]:
    with LoadMeter() as meter:
        out = asyncio.run(fn(*a))
    log(f"{name}: {meter.wall_s:.1f} s, other processes {meter.other_cores:.2f} cores")
    return out, {"wall_s": round(meter.wall_s, 2), **meter.as_dict()}


def record(args, config: str, repeat: int, **fields: Any) -> None:
    rec = base_record("kv_tier")
    rec.update(config=config, repeat=repeat, label=args.quick_label, versions=versions(),
               workload={k: getattr(args, k) for k in ("conversations", "turns", "system", "system_prompts", "user",
                         "answer", "rate", "think", "pool_fraction", "max_model_len", "threads")},
               **fields)  # fmt: skip
    write_jsonl(OUT, rec)
    log(f"{config}[{repeat}]: " + json.dumps({k: v for k, v in fields.items() if k != "raw"}))


def run_multi(args, model, config: str, repeat: int, tier_root: Path) -> None:
    blocks = pool_blocks_for(args)
    tier = None
    extra: dict[str, Any] = {}
    if config != "no_tier":
        tier = tier_root / f"{config}-{repeat}"
        extra["cache.disk_tier_direct_io"] = "true" if config == "disk_cold" else "false"
    s = ours(args, model, blocks, tier, **extra)
    try:
        res, load = measure(config, run_multi_turn, s.url, args, 1000 + repeat, range(args.turns))
    finally:
        s.stop()
    record(args, config, repeat, pool_blocks=blocks, **summarize(res), load=load, raw=res)


def run_restart(args, model, repeat: int, tier_root: Path) -> None:
    blocks = pool_blocks_for(args)
    seed = 2000 + repeat
    out: dict[str, Any] = {"pool_blocks": blocks}
    for kind in ("warm", "cold"):
        tier = tier_root / f"restart-{repeat}"
        if kind == "cold":
            tier = tier_root / f"restart-cold-{repeat}"
        else:
            s = ours(args, model, blocks, tier)
            try:
                asyncio.run(run_multi_turn(s.url, args, seed, range(1)))
            finally:
                t0 = time.perf_counter()
                s.stop()  # SIGTERM: the drain flushes the pool to the tier
                out["drain_s"] = round(time.perf_counter() - t0, 2)
        s = ours(args, model, blocks, tier)
        try:
            res, load = measure(f"restart_{kind}", run_multi_turn, s.url, args, seed, range(1, 2))
        finally:
            s.stop()
        ttfts = [r["ttft"] for r in res if r["ttft"] is not None]
        out[kind] = {"first_returning_ttft_p50_s": rnd(statistics.median(ttfts), 4),
                     "cached_tokens_mean": rnd(statistics.fmean([r["cached"] or 0 for r in res]), 1),
                     "load": load}  # fmt: skip
    out["speedup"] = rnd(
        out["cold"]["first_returning_ttft_p50_s"] / out["warm"]["first_returning_ttft_p50_s"], 2
    )
    record(args, "restart", repeat, **out)


def run_no_reuse(args, model, repeat: int, tier_root: Path) -> None:
    blocks = pool_blocks_for(args)
    out: dict[str, Any] = {"pool_blocks": blocks}
    for kind in ("off", "on"):
        tier = tier_root / f"no-reuse-{repeat}" if kind == "on" else None
        s = ours(args, model, blocks, tier)
        try:
            res, load = measure(f"no_reuse_{kind}", run_unique, s.url, args, 3000 + repeat)
        finally:
            s.stop()
        out[kind] = {**res, "load": load}
    out["ratio_on_off"] = rnd(out["on"]["output_tok_s"] / out["off"]["output_tok_s"], 3)
    record(args, "no_reuse", repeat, **out)


def run_vllm(args, model, repeat: int) -> None:
    python = CACHE_DIR / "vllm-venv" / "bin" / "python"
    if not python.exists():
        record(args, "vllm_offload", repeat, started=False,
               reason=f"no vLLM venv at {python} (bench/peers/setup_vllm.py builds it)")  # fmt: skip
        return
    port = free_port()
    st = settings(args, model)
    cmd, env = vllm_command(str(python), st, port)
    pool_gib = max(1, round(pool_blocks_for(args) * 737280 / (1 << 30)))
    env["VLLM_CPU_KVCACHE_SPACE"] = str(pool_gib)
    cmd += ["--enable-prefix-caching", "--kv-offloading-backend", "native",
            "--kv-offloading-size", str(int(args.tier_gib))]  # fmt: skip
    s = Server("vllm", cmd, env, port)
    try:
        s.wait_healthy(900)
    except RuntimeError as e:
        record(args, "vllm_offload", repeat, started=False, command=cmd[2:],
               reason=str(e).splitlines()[0], log_tail=str(e)[-3000:])  # fmt: skip
        s.stop()
        return
    try:
        res, load = measure(
            "vllm_offload", run_multi_turn, s.url, args, 1000 + repeat, range(args.turns)
        )
    finally:
        s.stop()
    record(args, "vllm_offload", repeat, started=True, command=cmd[2:], kv_cache_gib=pool_gib,
           **summarize(res), load=load, raw=res)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=2000)
    p.add_argument(
        "--system-prompts",
        type=int,
        default=1,
        help="distinct system prompts (conversation i uses i mod this)",
    )
    p.add_argument("--user", type=int, default=64)
    p.add_argument("--answer", type=int, default=32)
    p.add_argument("--rate", type=float, default=0.5, help="conversations started per second")
    p.add_argument("--think", type=float, default=1.0, help="mean seconds between turns")
    p.add_argument("--pool-fraction", type=float, default=0.25)
    p.add_argument("--max-model-len", type=int, default=2800)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tier-gib", type=float, default=8.0)
    p.add_argument("--unique", type=int, default=24, help="prompts of the no-reuse run")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--configs", default="no_tier,disk_warm,disk_cold,restart,no_reuse,vllm_offload")
    p.add_argument("--quick-label", default="full", help="recorded with every result")
    args = p.parse_args()
    model = ensure_model(args.model)
    log(f"model {model} {model_info(model)}; working set {working_set_tokens(args)} tokens, "
        f"pool {pool_blocks_for(args)} blocks of 16")  # fmt: skip
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tier_root = Path(tempfile.mkdtemp(prefix="kv-tier-bench-", dir=str(CACHE_DIR)))
    try:
        for repeat in range(args.repeats):
            for config in args.configs.split(","):
                if config in ("no_tier", "disk_warm", "disk_cold"):
                    run_multi(args, model, config, repeat, tier_root)
                elif config == "restart":
                    run_restart(args, model, repeat, tier_root)
                elif config == "no_reuse":
                    run_no_reuse(args, model, repeat, tier_root)
                elif config == "vllm_offload":
                    run_vllm(args, model, repeat)
                else:
                    raise SystemExit(f"unknown config {config!r}")
    finally:
        shutil.rmtree(tier_root, ignore_errors=True)


if __name__ == "__main__":
    main()
