"""Per-step time outside the model forward, by phase, at decode batch 1, 4 and 64.

Three views of the same decode step (prompts of 32 tokens, greedy, `ignore_eos`, every
request decoding):

- **offline**: `LLMEngine.step()` called in a loop. The phases are timed by wrapping the
  engine's own methods (nothing in the engine is changed for it):

      schedule     Scheduler.schedule                          (engine/core)
      inputs       ModelRunner._update_states + prepare_inputs (engine/worker/input_batch)
      forward      the model's forward                         (the model: reference)
      lm_head      model.compute_logits                        (the model: reference)
      runner_rest  the rest of ModelRunner.execute: row gather, sampling rows, appends
      sample       Sampler.__call__                            (engine/worker/sampler)
      update       Scheduler.update_from_output
      output       OutputProcessor.process + delta_for + the rest of step() (engine/output)

  `outside` = step − forward − lm_head: what a step costs beyond the model.
- **async**: the same engine behind `AsyncEngine`, B consumers reading their
  `RequestStream`s on this process's event loop (as a frontend does). Reported: the engine
  thread's step wall time and the consumers' inter-token latency (ITL p50); their
  difference is the loop's work outside `step()` (inbox, deliveries, stats) plus the
  handoff to the event loop and the stream.
- **http**: `appliance serve` in a subprocess (its own interpreter, as deployed), B
  streaming `/v1/completions` clients from this process; ITL p50 between SSE chunks.

`served − offline step` at the same batch is what the async layer, the event-loop
handoffs, the HTTP/SSE path and GIL contention between the server loop and the engine
thread add per token. Medians over steps, then over `--repeats` runs.

    python bench/step_overhead.py --quick                 # tiny random model, seconds
    python bench/step_overhead.py                         # llama50m, batches 1,4,64
    python bench/step_overhead.py --modes offline --profile 4   # + cProfile of batch 4

A JSON line per run goes to bench/results/step_overhead.jsonl (`--no-save`: none).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import CACHE_DIR, cpu_model  # noqa: E402

PHASES = (
    "schedule", "inputs", "forward", "lm_head", "runner_rest", "sample", "update", "output",
)  # fmt: skip
PROMPT_LEN = 32
VOCAB = [40_000]  # prompt ids are drawn below this: the model's vocabulary (engine_sets)


def engine_sets(args: argparse.Namespace) -> list[str]:
    if args.quick:
        from tests.support.tiny_models import make_tiny_checkpoint

        model = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama")
    else:
        model = args.model
    config_dir = Path(model)
    if not config_dir.is_dir():  # a .gguf file: its config is in the converted directory
        from engine.worker.models.loader import resolve_model_path

        config_dir = resolve_model_path(model)
    VOCAB[0] = json.loads((config_dir / "config.json").read_text())["vocab_size"]
    return [
        f"model.path={model}", "model.dtype=float32", "runtime.device=cpu",
        f"runtime.num_threads={args.threads}", "cache.cpu_kv_cache_gib=0.5",
        "scheduler.max_num_seqs=128", *args.sets,
    ]  # fmt: skip


def build_engine(sets: list[str]):
    from appliance.config import load_config
    from engine.llm_engine import LLMEngine

    return LLMEngine(load_config(None, sets, {}).engine_config())


def build_async_engine(sets: list[str]):
    """As `appliance serve` builds it: the engine loaded on the thread that steps it."""
    from appliance.config import load_config
    from engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(load_config(None, sets, {}).engine_config())


def prompts(batch: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (ids >= 100: clear of special tokens): no prefix hits."""
    import random

    rng = random.Random(seed)
    hi = min(VOCAB[0], 40_000)
    return [[rng.randrange(100, hi) for _ in range(PROMPT_LEN)] for _ in range(batch)]


# ---- offline -------------------------------------------------------------------------------


class PhaseClock:
    """Wraps the engine's methods with timers; `step()` runs one step and
    returns its phases in ns."""

    def __init__(self, eng, stub: bool = False):
        self.acc: dict[str, int] = defaultdict(int)  # wall ns per phase, this step
        self.cpu: dict[str, int] = defaultdict(int)  # this thread's CPU ns per phase
        self.eng = eng
        runner, sched, outs = eng.runner, eng.scheduler, eng.outputs
        self._wrap(sched, "schedule", "schedule")
        self._wrap(sched, "update_from_output", "update")
        self._wrap(runner, "_update_states", "inputs")
        self._wrap(runner, "prepare_inputs", "inputs")
        self._wrap(runner, "execute", "execute")
        self._wrap(outs, "process", "output")
        self._wrap(outs, "delta_for", "output")
        runner.sampler = self._timed(runner.sampler, "sample")
        runner.model = _TimedModel(runner.model, self, stub)

    def _timed(self, fn, phase: str):
        acc, cpu = self.acc, self.cpu
        wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns

        def timed(*a, **kw):
            t0, c0 = wall_clock(), cpu_clock()
            try:
                return fn(*a, **kw)
            finally:
                cpu[phase] += cpu_clock() - c0
                acc[phase] += wall_clock() - t0

        return timed

    def _wrap(self, obj, name: str, phase: str) -> None:
        setattr(obj, name, self._timed(getattr(obj, name), phase))

    def step(self) -> dict[str, int]:
        """One engine step: wall ns per phase, and `cpu_*`: this thread's CPU ns (the
        robust figure on a shared box for the single-threaded phases)."""
        self.acc.clear()
        self.cpu.clear()
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        self.eng.step()
        c1 = time.thread_time_ns()
        total = time.perf_counter_ns() - t0
        phases = self._split(self.acc, total)
        phases.update({f"cpu_{k}": v for k, v in self._split(self.cpu, c1 - c0).items()})
        return phases

    @staticmethod
    def _split(a: dict[str, int], total: int) -> dict[str, int]:
        inner = a["inputs"] + a["forward"] + a["lm_head"] + a["sample"]
        phases = {p: a[p] for p in PHASES}
        phases["runner_rest"] = a["execute"] - inner
        phases["output"] = total - a["schedule"] - a["execute"] - a["update"]
        phases["step"] = total
        phases["outside"] = total - a["forward"] - a["lm_head"]
        return phases


class _TimedModel:
    """Stands in for runner.model: times the forward and the LM head, delegates the rest.

    `stub`: the forward and the LM head return fixed tensors of the right shapes instead
    of computing (no model time, no cache pollution by the weights: the outside phases
    alone, steady even on a loaded box)."""

    def __init__(self, model, clock: PhaseClock, stub: bool = False):
        self._model = model
        forward, logits = model, model.compute_logits
        if stub:
            import torch

            hidden = torch.randn(4096, model.model.embed_tokens.weight.shape[1])
            table = torch.randn(256, model.vocab_size)

            def forward(input_ids, positions, ctx):
                return hidden[: input_ids.shape[0]]

            def logits(h):
                return table[: h.shape[0]]

        self._call = clock._timed(forward, "forward")
        self.compute_logits = clock._timed(logits, "lm_head")

    def __call__(self, *a, **kw):
        return self._call(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


def fill_decode(eng, batch: int, seed: int, steps: int) -> None:
    """Adds `batch` requests and steps until every one is decoding."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 64, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts(batch, seed)):
        eng.add_request(f"s{seed}-{i}", p, params)
    while any(r.num_output_tokens == 0 for r in eng.scheduler.requests.values()):
        eng.step()


def offline(eng, clock: PhaseClock, batch: int, steps: int, seed: int, profile: bool):
    fill_decode(eng, batch, seed, steps)
    for _ in range(3):
        clock.step()
    prof = cProfile.Profile() if profile else None
    rows = []
    if prof:
        prof.enable()
    for _ in range(steps):
        rows.append(clock.step())
    if prof:
        prof.disable()
    eng.abort([f"s{seed}-{i}" for i in range(batch)])
    while eng.has_unfinished_requests():
        eng.step()
    med = {k: statistics.median(r[k] for r in rows) / 1e3 for k in rows[0]}
    return med, prof


# ---- async (in-process AsyncEngine) ---------------------------------------------------------


class StepTimer:
    """Wraps `eng.step` to record the wall time of each step that ran `batch` requests."""

    def __init__(self, eng, batch: int):
        self.eng, self.batch, self.inner = eng, batch, eng.step
        self.ns: list[int] = []

    def __enter__(self) -> StepTimer:
        eng, inner, ns = self.eng, self.inner, self.ns

        def timed_step():
            t0 = time.perf_counter_ns()
            out = inner()
            if eng.scheduler.num_running == self.batch:
                ns.append(time.perf_counter_ns() - t0)
            return out

        eng.step = timed_step
        return self

    def __exit__(self, *exc: object) -> None:
        del self.eng.step  # the class's method again

    def median_us(self) -> float:
        return statistics.median(self.ns[3:] or self.ns) / 1e3


def _gaps_from(first_useful: int):
    """A recorder of gaps between a stream's arrivals, past its first `first_useful`."""
    gaps: list[float] = []

    def stream_clock():
        state = {"last": None, "seen": 0}

        def tick() -> None:
            now = time.perf_counter()
            state["seen"] += 1
            if state["last"] is not None and state["seen"] > first_useful:
                gaps.append(now - state["last"])
            state["last"] = now

        return tick

    return gaps, stream_clock


async def async_run(aeng, batch: int, steps: int, seed: int) -> dict[str, float]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    gaps, stream_clock = _gaps_from(8)  # past the prefill and the first tokens

    async def one(i: int, prompt: list[int]) -> None:
        stream = await aeng.add_request(prompt, params, f"a{seed}-{i}")
        tick = stream_clock()
        async for _ in stream:
            tick()

    with StepTimer(aeng.engine, batch) as timer:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(batch, seed))))
    return _served(timer, gaps)


def _served(timer: StepTimer, gaps: list[float]) -> dict[str, float]:
    step, itl = timer.median_us(), statistics.median(gaps) * 1e6
    return {"step": step, "itl_p50": itl, "itl_minus_step": itl - step}


# ---- http (this process serves, a child process is the client) -----------------------------


async def http_client(url: str, batch: int, max_tokens: int, seed: int) -> list[float]:
    """B streaming /v1/completions requests at once; the gaps between SSE chunks (s)."""
    import httpx

    gaps, stream_clock = _gaps_from(8)

    async def one(client, prompt: list[int]) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        tick = stream_clock()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    tick()

    limits = httpx.Limits(max_connections=batch + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await one(client, prompts(1, seed + 99)[0])  # warm the connection
        gaps.clear()
        await asyncio.gather(*(one(client, p) for p in prompts(batch, seed)))
    return gaps


def http_run(eng, url: str, batch: int, steps: int, seed: int) -> dict[str, float]:
    """The server runs here (uvicorn's loop on one thread, the engine loop on another: one
    interpreter, as `appliance serve`); the load generator is a child process, so that
    its work does not compete for this process's GIL."""
    import subprocess

    cmd = [
        sys.executable, __file__, "--client", url, "--batches", str(batch),
        "--steps", str(steps), "--seed", str(seed), "--vocab", str(VOCAB[0]),
    ]  # fmt: skip
    with StepTimer(eng, batch) as timer:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return _served(timer, json.loads(out.stdout.strip().splitlines()[-1]))


# ---- main ----------------------------------------------------------------------------------


def _git_head() -> str:
    import subprocess

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
    return out.stdout.decode().strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny random model, short runs")
    ap.add_argument("--model", default=str(CACHE_DIR / "models" / "llama50m"))
    ap.add_argument("--batches", default="1,4,64")
    ap.add_argument("--steps", type=int, default=60, help="timed decode steps per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="offline,async,http")
    ap.add_argument(
        "--stub-model", action="store_true",
        help="offline only: the forward and LM head return fixed tensors (outside phases alone)",
    )  # fmt: skip
    ap.add_argument("--profile", type=int, default=0, help="cProfile the offline run at this batch")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument(
        "--switch-interval", type=float, default=None,
        help="sys.setswitchinterval (s) for the served modes: the GIL contention experiment",
    )  # fmt: skip
    ap.add_argument("--client", help=argparse.SUPPRESS)  # the http mode's child process
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        VOCAB[0] = args.vocab
        gaps = asyncio.run(http_client(args.client, int(args.batches), args.steps + 8, args.seed))
        print(json.dumps(gaps))
        return
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.quick:
        args.steps = min(args.steps, 30)
        args.repeats = min(args.repeats, 2)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    sets = engine_sets(args)
    record: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "bench": "step_overhead",
        "cpu": cpu_model(), "cores": os.cpu_count(), "quick": args.quick,
        "threads": args.threads, "steps": args.steps, "repeats": args.repeats,
        "stub_model": args.stub_model, "git": _git_head(),
        "switch_interval": sys.getswitchinterval(),
    }  # fmt: skip
    med = statistics.median

    def offline_mode() -> None:
        """On a thread of its own, which exits after: its OpenMP pool goes with it, so the
        async and http modes below run as served (engine/loop_thread.py)."""
        eng = build_engine(sets)
        clock = PhaseClock(eng, args.stub_model)
        res = {}
        for b in batches:
            runs = []
            for r in range(args.repeats):
                prof = args.profile == b and r == 0
                m, p = offline(eng, clock, b, args.steps, seed=1000 * b + r, profile=prof)
                runs.append(m)
                if p is not None:
                    s = io.StringIO()
                    pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(45)
                    print(s.getvalue())
            res[b] = {k: round(med(run[k] for run in runs), 1) for k in runs[0]}
            res[b]["outside_runs"] = [round(run["outside"], 1) for run in runs]
            print(f"\noffline batch {b:3d} µs/step: " + json.dumps(res[b]))
        record["offline"] = res

    if "offline" in modes:
        t = threading.Thread(target=offline_mode)
        t.start()
        t.join()
    if "async" in modes:
        aeng = build_async_engine(sets)
        res = {}
        for b in batches:
            runs = [
                asyncio.run(async_run(aeng, b, args.steps, seed=2000 * b + r))
                for r in range(args.repeats)
            ]
            res[b] = {k: round(med(run[k] for run in runs), 1) for k in runs[0]}
            print(f"async   batch {b:3d} µs: " + json.dumps(res[b]))
        record["async"] = res
        asyncio.run(aeng.shutdown())
        del aeng
    if "http" in modes:
        from appliance.config import ServerConfig
        from appliance.http.app import build_app
        from appliance.http.server import BackgroundServer

        aeng = build_async_engine(sets)
        eng = aeng.engine
        server = BackgroundServer(build_app(aeng, ServerConfig(host="127.0.0.1"))).start()
        try:
            res = {}
            for b in batches:
                runs = [
                    http_run(eng, server.url, b, args.steps, seed=3000 * b + r)
                    for r in range(args.repeats)
                ]
                res[b] = {k: round(med(run[k] for run in runs), 1) for k in runs[0]}
                res[b]["itl_p50_runs"] = [round(run["itl_p50"], 1) for run in runs]
                print(f"http    batch {b:3d} µs: " + json.dumps(res[b]))
            record["http"] = res
        finally:
            server.stop()
            asyncio.run(aeng.shutdown())
    if not args.no_save:
        out = ROOT / "bench" / "results" / "step_overhead.jsonl"
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
