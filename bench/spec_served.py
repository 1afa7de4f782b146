"""Speculation served (issue 27): open-ended saturation, and a mixed workload at 1 and 4 req/s.

Servers of ours (`appliance serve`, the default model's float32 checkpoint from
bench/float_checkpoint.py as in bench/spec_copy.py, 2 threads), all up together, one per
`--configs` entry:

    none          no speculation
    ngram-fixed   n-gram prompt lookup, k = 4 on every decode (`adaptive: false`)
    ngram         the same with the adaptive rule (engine/core/spec/adaptive.py), the default
    vllm-none     vLLM CPU's OpenAI server (bench/peers/setup_vllm.py's venv, bench/servers.py's
                  command: same checkpoint, dtype, threads, max_num_seqs), no speculation
    vllm-ngram    the same with `--speculative-config` n-gram k 4 (lookup 4, as vLLM
                  resolves its defaults), the peer of the issue's goals

Workloads, each sent to every server in turn (the order rotated by round, so a drift in the
box's load falls on all alike):

- `saturation`: `--concurrency` open-ended requests at a time (bench/serving_stats.PROMPTS,
  `--max-tokens`, greedy, ignore_eos), closed loop, `--saturation-requests` in all: output
  tokens/s. Goal: speculation ≥ 0.97× no speculation (nothing to copy, so the adaptive
  rule must stop proposing);
- `mixed@R`: Poisson arrivals at R req/s for `--duration` s, half open-ended prompts, half
  the copy task (rewrite a piece of textwrap.py, rendered with the chat template and sent
  as token ids): mean TPOT per request ((last token - first token) / (tokens - 1), from the
  stream). Goal at 4 req/s: adaptive below both fixed k and none.

Every workload runs `--rounds` times (the servers' order rotated again each round); each
figure is the median over the rounds, every round's row kept beside it. Every request's
text is kept: for each (workload, request) the servers' greedy outputs must be identical
in every round (`greedy_identical`). One JSON line goes to bench/results/spec_served.jsonl.

    python bench/spec_served.py                      # 3 rounds, ~18 minutes on 2 cores
    python bench/spec_served.py --configs none,ngram-fixed,ngram,vllm-none,vllm-ngram
    python bench/spec_served.py --rates 1 --duration 10 --saturation-requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, LoadMeter, base_record, log, write_jsonl  # noqa: E402
from bench.float_checkpoint import smollm2_float_dir  # noqa: E402
from bench.peers import setup_vllm  # noqa: E402
from bench.servers import Server, ServerSettings, free_port, vllm_command  # noqa: E402
from bench.serving_stats import PROMPTS  # noqa: E402
from bench.spec_copy import copy_messages  # noqa: E402

CONFIGS = {
    "none": {"speculative.method": "none"},
    "ngram-fixed": {"speculative.method": "ngram", "speculative.num_speculative_tokens": 4,
                    "speculative.adaptive": "false"},
    "ngram": {"speculative.method": "ngram", "speculative.num_speculative_tokens": 4,
              "speculative.adaptive": "true"},
}  # fmt: skip


@dataclass
class Result:
    kind: str  # open | copy
    ok: bool = False
    ttft: float = 0.0
    text: str = ""
    error: str = ""
    times: list[float] = field(default_factory=list, repr=False)


VLLM_SPEC = {"vllm-none": None,
             "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_max": 4}}  # fmt: skip


def start(name: str, model: str, threads: int) -> Server:
    port = free_port()
    if name in VLLM_SPEC:
        st = setup_vllm.state()
        if not st["ok"]:
            raise RuntimeError(f"vLLM peer not installed: {st['error']}")
        settings = ServerSettings(model=model, dtype="float32", kv_cache_gib=1, threads=threads,
                                  max_num_seqs=64, max_num_batched_tokens=2048,
                                  max_model_len=2048)  # fmt: skip
        cmd, env = vllm_command(st["python"], settings, port)
        if VLLM_SPEC[name] is not None:
            cmd += ["--speculative-config", json.dumps(VLLM_SPEC[name])]
        return Server(name, cmd, env, port)
    sets = {
        "model.path": model, "model.served_name": "bench", "model.dtype": "float32",
        "runtime.device": "cpu", "runtime.num_threads": threads, "scheduler.max_num_seqs": 64,
        "server.host": "127.0.0.1", "server.http_port": port, "server.grpc_port": "null",
        **CONFIGS[name],
    }  # fmt: skip
    cmd = [sys.executable, "-m", "appliance", "serve"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return Server(name, cmd, {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}, port)


async def request(client: httpx.AsyncClient, prompt, kind: str, max_tokens: int) -> Result:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    r = Result(kind)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}"
                return r
            parts = []
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                text = choices[0].get("text", "") if choices else ""
                if text:
                    r.times.append(time.perf_counter() - t0)
                    parts.append(text)
        r.text = "".join(parts)
    except httpx.HTTPError as e:
        r.error = repr(e)
        return r
    r.ok = True
    if r.times:
        r.ttft = r.times[0]
    return r


def tpot(r: Result, tokenizer) -> float | None:
    """(last chunk - first chunk) / (tokens - 1), tokens counted from the text."""
    if not r.ok or len(r.times) < 2:
        return None
    n = len(tokenizer.encode(r.text, add_special_tokens=False))
    return (r.times[-1] - r.times[0]) / max(1, n - 1)


async def saturation(url: str, n: int, conc: int, max_tokens: int) -> tuple[list[Result], float]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    out: list[Result] = [Result("open")] * n
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                out[i] = await request(client, PROMPTS[i % len(PROMPTS)], "open", max_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return out, time.perf_counter() - t0


async def mixed(url: str, plan: list[tuple[float, str, object]], max_tokens: int) -> list[Result]:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        t0 = time.perf_counter()

        async def one(at: float, kind: str, prompt) -> Result:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return await request(client, prompt, kind, max_tokens)

        return list(await asyncio.gather(*(one(*p) for p in plan)))


def mixed_plan(rate: float, duration: float, copy_ids: list[int], seed: int):
    rng = random.Random(seed)
    t, plan, i = 0.0, [], 0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            return plan
        plan.append((t, "copy", copy_ids) if i % 2 else (t, "open", PROMPTS[i % len(PROMPTS)]))
        i += 1


def run_workload(
    url: str, rate: float | None, args, copy_ids: list[int], tok
) -> tuple[dict, list[str]]:
    """One workload on one server: its figures, and every request's text (in plan order)."""
    with LoadMeter() as load:
        if rate is None:
            res, wall = asyncio.run(
                saturation(url, args.saturation_requests, args.concurrency, args.max_tokens)
            )
        else:
            plan = mixed_plan(rate, args.duration, copy_ids, args.seed)
            t0 = time.perf_counter()
            res = asyncio.run(mixed(url, plan, args.max_tokens))
            wall = time.perf_counter() - t0
    ok = [r for r in res if r.ok]
    tp = [x for x in (tpot(r, tok) for r in ok) if x is not None]
    row = {
        "requests": len(res), "failed": len(res) - len(ok), "wall_s": round(wall, 2),
        "output_tok_per_s": round(sum(len(tok.encode(r.text, add_special_tokens=False))
                                      for r in ok) / wall, 2),
        "mean_tpot_ms": round(statistics.fmean(tp) * 1e3, 2) if tp else None,
        "mean_tpot_ms_by_kind": {
            k: round(statistics.fmean(v) * 1e3, 2) if v else None
            for k in ("open", "copy")
            for v in [[x for r in ok if r.kind == k
                       for x in [tpot(r, tok)] if x is not None]]
        },
        "other_cores": load.as_dict().get("other_cores"),
    }  # fmt: skip
    return row, [r.text for r in res]


def summarize(rounds: list[dict]) -> dict:
    """One config's rows over the rounds: the median of each figure, and every round's."""

    def med(xs: list) -> float | None:
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 2) if xs else None

    out = {
        "requests": rounds[0]["requests"],
        "failed": sum(r["failed"] for r in rounds),
        "output_tok_per_s": med([r["output_tok_per_s"] for r in rounds]),
        "mean_tpot_ms": med([r["mean_tpot_ms"] for r in rounds]),
        "mean_tpot_ms_by_kind": {
            k: med([r["mean_tpot_ms_by_kind"][k] for r in rounds]) for k in ("open", "copy")
        },
        "other_cores": max((r["other_cores"] or 0.0) for r in rounds),
    }
    if len(rounds) > 1:
        out["rounds"] = rounds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="none,ngram-fixed,ngram")
    ap.add_argument("--rates", default="1,4")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--saturation-requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="repeats; figures are medians")
    ap.add_argument("--out", default=str(RESULTS_DIR / "spec_served.jsonl"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model = str(smollm2_float_dir())
    tok = AutoTokenizer.from_pretrained(model)
    copy_ids = tok.apply_chat_template(copy_messages(), add_generation_prompt=True, tokenize=True)
    if not isinstance(copy_ids, list):
        copy_ids = list(copy_ids["input_ids"])
    names = args.configs.split(",")
    servers = {n: start(n, model, args.threads) for n in names}
    record = {**base_record("spec_served"), "settings": vars(args), "workloads": {}}
    try:
        for s in servers.values():
            s.wait_healthy(900)
        log("servers up: " + ", ".join(names))
        workloads = [("saturation", None)] + [
            (f"mixed@{r}", float(r)) for r in args.rates.split(",")
        ]
        rows: dict[str, dict[str, list[dict]]] = {wname: {} for wname, _ in workloads}
        first: dict[str, list[str]] = {}  # each workload's first answers, to compare with
        identical = dict.fromkeys(rows, True)
        for rnd in range(args.rounds):
            for w, (wname, rate) in enumerate(workloads):
                shift = (w + rnd) % len(names)
                for name in names[shift:] + names[:shift]:
                    row, out = run_workload(servers[name].url, rate, args, copy_ids, tok)
                    rows[wname].setdefault(name, []).append(row)
                    identical[wname] &= out == first.setdefault(wname, out)
                    log(f"{wname} round {rnd} {name}: {row}")
        for wname, per_config in rows.items():
            record["workloads"][wname] = {
                **{n: summarize(r) for n, r in per_config.items()},
                "greedy_identical": identical[wname],
            }
    finally:
        for s in servers.values():
            s.stop()
    sat = record["workloads"].get("saturation", {})
    goals = {}
    if "none" in sat:
        for n in names:
            if n != "none" and n in sat:
                goals[f"saturation_{n}_over_none"] = round(
                    sat[n]["output_tok_per_s"] / sat["none"]["output_tok_per_s"], 3
                )
    mixed4 = record["workloads"].get("mixed@4", {})
    if {"none", "ngram", "ngram-fixed"} <= set(mixed4):
        t = {n: mixed4[n]["mean_tpot_ms"] for n in ("none", "ngram", "ngram-fixed")}
        goals["mixed@4_adaptive_below_none_and_fixed"] = t["ngram"] < min(
            t["none"], t["ngram-fixed"]
        )
        per_round = zip(*(mixed4[n].get("rounds", [mixed4[n]]) for n in t), strict=True)
        goals["mixed@4_rounds_adaptive_lowest"] = [
            none["mean_tpot_ms"] > ada["mean_tpot_ms"] < fixed["mean_tpot_ms"]
            for none, ada, fixed in per_round
        ]
    record["goals"] = goals
    print(json.dumps(record["goals"], indent=1))
    write_jsonl(Path(args.out), record)
    log(f"appended to {args.out}")


if __name__ == "__main__":
    main()
