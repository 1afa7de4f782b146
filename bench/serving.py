"""Serving benchmark: HTTP load at several concurrency levels, and the server's overhead.

Starts `appliance serve` as a subprocess (its own process, so the load generator does not
share its GIL), streams `/v1/completions` from many concurrent clients with httpx, and
reports request throughput, output token throughput, TTFT, inter-token latency (ITL) and
end-to-end latency percentiles per concurrency level. Then stops the server and runs the
same workload through the offline engine (`LLM.generate`) in this process; overhead is the
server's wall time at full concurrency over the offline wall time, minus one.

    python bench/serving.py --tiny                      # tiny random model, seconds
    python bench/serving.py --concurrency 1,8,32 -n 64  # default model (SmolLM2-135M)
    python bench/serving.py --set model.path=/models/x --set runtime.device=cuda

Every result is a JSON line appended to bench/results/serving.jsonl. ITL is measured
between SSE chunks: a chunk carries every token produced since the client last read, so
under load a chunk can hold more than one token. The machine's CPU use by other processes
during each run is recorded (`other_cpu_cores`), since this box is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from appliance.config import load_config  # noqa: E402
from bench.serving_stats import (  # noqa: E402
    BRIEF_KEYS,
    PROMPTS,
    Sample,
    run_workers,
    summarize,
    write_rows,
)

RESULTS = ROOT / "bench" / "results" / "serving.jsonl"


class CpuMeter:
    """Machine-wide busy cores minus this benchmark's own processes, from /proc."""

    def __init__(self, pids: list[int]):
        self.pids = pids

    @staticmethod
    def _machine() -> tuple[float, float]:
        with open("/proc/stat") as f:
            v = [float(x) for x in f.readline().split()[1:]]
        idle = v[3] + v[4]
        return sum(v) - idle, sum(v)

    def _own(self) -> float:
        tick = os.sysconf("SC_CLK_TCK")
        total = sum(os.times()[:2])
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                total += (float(parts[11]) + float(parts[12])) / tick
            except OSError:
                pass
        return total

    def __enter__(self) -> CpuMeter:
        self.t0 = time.monotonic()
        self.busy0, self.total0 = self._machine()
        self.own0 = self._own()
        return self

    def __exit__(self, *exc: object) -> None:
        busy1, total1 = self._machine()
        ncpu = os.cpu_count() or 1
        wall = time.monotonic() - self.t0
        machine_cores = (busy1 - self.busy0) / max(total1 - self.total0, 1) * ncpu
        own_cores = (self._own() - self.own0) / max(wall, 1e-9)
        self.other_cores = round(max(0.0, machine_cores - own_cores), 2)
        self.own_cores = round(own_cores, 2)


async def one_request(
    client: httpx.AsyncClient, prompt: str | list[int], max_tokens: int, model: str | None = None
) -> Sample:
    """One streamed greedy /v1/completions request (text or token ids, ignore_eos). Chunks
    without text count for neither TTFT nor ITL: a token that detokenizes to nothing yet
    (part of a UTF-8 character) reaches the client with the next one, whichever server sends
    an empty chunk for it (vLLM does, we do not). Also bench/serving_vs.py's client."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if model is not None:
        body["model"] = model
    t0 = time.perf_counter()
    s = Sample(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    s.tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                s.chunk(now, t0)
        s.e2e = time.perf_counter() - t0
        s.ok = True
    except httpx.HTTPError as e:
        s.error = repr(e)
    return s


async def run_level(
    url: str, concurrency: int, n: int, max_tokens: int
) -> tuple[list[Sample], float]:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await one_request(client, PROMPTS[0], 2)  # warm the connection and the engine
        return await run_workers(
            lambda prompt: one_request(client, prompt, max_tokens), PROMPTS, n, concurrency
        )


def start_server(sets: list[str], config: str | None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "appliance", "serve", *(["--config", config] if config else [])]
    for s in [*sets, "server.http_port=0", "server.grpc_port=null", "telemetry.log_format=json"]:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    port: list[int] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("msg") == "http listening":
                port.append(rec["port"])
                seen.set()
            elif rec.get("level") in ("error", "critical"):
                print("server:", line.strip(), file=sys.stderr)

    threading.Thread(target=read, daemon=True).start()
    if not seen.wait(600):
        proc.kill()
        raise RuntimeError("server did not start")
    return proc, f"http://127.0.0.1:{port[0]}"


def offline(
    sets: list[str], config: str | None, n: int, max_tokens: int, repeats: int
) -> tuple[list[float], int]:
    """Wall times of `repeats` runs of the workload through LLM.generate."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    cfg = load_config(config, sets, os.environ).engine_config()
    llm = LLM(config=cfg)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    walls, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(n)], params, use_tqdm=False)
        walls.append(round(time.perf_counter() - t0, 4))
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return walls, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (smoke run)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("-n", "--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs of the overhead comparison")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    sets = list(args.sets)
    if args.tiny:
        from tests.support.tiny_models import make_tiny_checkpoint

        tiny = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama")
        sets = [f"model.path={tiny}", "runtime.device=cpu", *sets]
    levels = [int(x) for x in args.concurrency.split(",")]
    meta = {
        "bench": "serving", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(),
        "cpus": os.cpu_count(), "sets": sets, "config": args.config,
        "num_requests": args.num_requests, "max_tokens": args.max_tokens,
    }  # fmt: skip
    rows = []
    proc, url = start_server(sets, args.config)
    try:
        # The last level sends everything at once, like the offline run; it is repeated and
        # the best run kept, as offline is, since this machine is shared.
        plan = [*((c, 1) for c in levels), (args.num_requests, args.repeats)]
        for c, repeats in plan:
            best, walls = None, []
            for _ in range(repeats):
                with CpuMeter([proc.pid]) as cpu:
                    run = asyncio.run(run_level(url, c, args.num_requests, args.max_tokens))
                walls.append(round(run[1], 4))
                if best is None or run[1] < best[0][1]:
                    best = (run, cpu)
            assert best is not None
            (samples, wall), cpu = best
            row = {**meta, "mode": "http", "concurrency": c, **summarize(samples, wall), "walls_s": walls,
                   "other_cpu_cores": cpu.other_cores, "own_cpu_cores": cpu.own_cores}  # fmt: skip
            rows.append(row)
            print(json.dumps({k: row[k] for k in BRIEF_KEYS}))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    with CpuMeter([]) as cpu:
        off_walls, off_tokens = offline(
            sets, args.config, args.num_requests, args.max_tokens, args.repeats
        )
    off_wall = min(off_walls)
    full = rows[-1]
    off = {**meta, "mode": "offline", "wall_s": round(off_wall, 3), "walls_s": off_walls,
           "output_tok_per_s": round(off_tokens / off_wall, 2),
           "server_overhead": round(full["wall_s"] / off_wall - 1, 4),
           "other_cpu_cores": cpu.other_cores}  # fmt: skip
    rows.append(off)
    print(json.dumps({k: off[k] for k in ("wall_s", "output_tok_per_s", "server_overhead")}))
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
