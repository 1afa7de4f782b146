"""Scheduler + KV cache manager CPU time per step, without a model.

Two scenarios, both with a fake runner that samples token 7 for every request that samples:

- decode: 256 running requests, every step one decode token each (steady state, no arrivals,
  no finishes);
- prefill-mix: 128 running decodes plus a stream of long prompts (1,000-3,000 tokens) that
  are chunked into the rest of a 2,048-token budget; requests finish after 32-96 tokens and
  new ones arrive to keep the mix steady.

Each runs twice more under the `fair` policy, with the requests spread over 8 tenants of
different weights and every request carrying a deadline (the counter charges, the per-tenant
queues and the deadline heap all in play), and a third scenario puts a flood in the queue:

- flood: 128 running decodes (4 tenants) and 512 waiting requests of one tenant beside a
  trickle from three others, under fcfs and fair (admission picks a tenant per request).

Timed per step: `schedule()` + `update_from_output()` (+ the `add_request` calls of the mix),
as this thread's CPU time (the cores are shared; wall time is reported beside it). Building
the fake runner output is not timed. Prints the median over repeats of µs per step and µs per
running request per step (goal: <= 10), the fair / fcfs ratio of each pair (same
invocation), and appends one JSON line to bench/results/scheduler_overhead.jsonl.

    python bench/scheduler_overhead.py [--repeats 7] [--steps 200]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config import SchedulerConfig  # noqa: E402
from engine.core.kv_cache.manager import KVCacheManager  # noqa: E402
from engine.core.policy.tenant import Tenant  # noqa: E402
from engine.core.request import Request  # noqa: E402
from engine.core.scheduler import Scheduler  # noqa: E402
from engine.core.step_io import RunnerOutput, SchedulerOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
GOAL_US_PER_REQUEST = 10.0


def fake_runner_output(sched: Scheduler, so: SchedulerOutput) -> RunnerOutput:
    """Token 7 for every scheduled request whose known tokens are all computed."""
    ids = []
    get = sched.requests.get
    for rid in so.num_scheduled_tokens:
        req = get(rid)
        if req is not None and req.num_computed_tokens == len(req.all_token_ids):
            ids.append(rid)
    return RunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids])


# The fair variants' tenants: weights 1..8, requests assigned round-robin.
TENANTS = tuple(Tenant(f"t{i}", weight=float(i + 1)) for i in range(8))


class Scenario:
    """One scheduler with its own KV pool and request stream; `fair`: the fair policy, the
    requests spread over `TENANTS`, each with a deadline an hour away."""

    def __init__(
        self,
        name: str,
        num_blocks: int,
        max_num_seqs: int,
        budget: int,
        seed: int,
        fair: bool = False,
    ):
        self.name = name
        cfg = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_queue_len=100_000,
            policy="fair" if fair else "fcfs",
        )  # fmt: skip
        self.sched = Scheduler(cfg, KVCacheManager(num_blocks, BLOCK_SIZE), MAX_MODEL_LEN)
        self.rng = random.Random(seed)
        self.next_id = 0
        self.fair = fair

    def make_request(
        self, prompt_len: int, max_tokens: int, tenant: Tenant | None = None
    ) -> Request:
        """The engine's side of an arrival (not timed): a request with a unique prompt."""
        rid = f"{self.name}-{self.next_id}"
        self.next_id += 1
        base = self.next_id * 10_000
        prompt = list(range(base, base + prompt_len))  # unique: no prefix hits
        deadline = None
        if self.fair:
            tenant = tenant or TENANTS[self.next_id % len(TENANTS)]
            deadline = time.monotonic() + 3600.0
        return Request(
            rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            tenant=tenant, deadline=deadline,
        )  # fmt: skip

    def add(self, prompt_len: int, max_tokens: int, tenant: Tenant | None = None) -> None:
        self.sched.add_request(self.make_request(prompt_len, max_tokens, tenant))

    def arrivals(self) -> list[Request]:
        """Requests arriving before this step (none in steady-state decode)."""
        return []

    def step(self) -> tuple[int, int, int, int]:
        """One step: (thread CPU ns, wall ns, requests scheduled, tokens scheduled).

        Timed: `add_request` for the arrivals, `schedule()`, `update_from_output()`.
        """
        arrivals = self.arrivals()
        sched = self.sched
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        for req in arrivals:
            sched.add_request(req)
        so = sched.schedule()
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        ro = fake_runner_output(sched, so)
        c2, w2 = time.thread_time_ns(), time.perf_counter_ns()
        sched.update_from_output(so, ro)
        c3, w3 = time.thread_time_ns(), time.perf_counter_ns()
        cpu, wall = (c1 - c0) + (c3 - c2), (w1 - w0) + (w3 - w2)
        return cpu, wall, len(so.num_scheduled_tokens), so.total_num_scheduled_tokens


class DecodeScenario(Scenario):
    def __init__(self, num_requests: int = 256, prompt_len: int = 128, fair: bool = False):
        super().__init__("decode", 256 * 64, num_requests, 8192, seed=0, fair=fair)
        for _ in range(num_requests):
            self.add(prompt_len, MAX_MODEL_LEN - prompt_len)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.sched.running) or (
            self.sched.num_waiting
        ):
            self.step()


class PrefillMixScenario(Scenario):
    def __init__(self, num_decodes: int = 128, fair: bool = False):
        super().__init__("prefill-mix", 8192, 256, 2048, seed=1, fair=fair)
        self.num_decodes = num_decodes
        for _ in range(num_decodes):
            self.add(self.rng.randint(64, 512), self.rng.randint(32, 96))
        for _ in range(50):  # warm up into the mix
            self.step()

    def arrivals(self) -> list[Request]:
        sched, rng = self.sched, self.rng
        # Keep about num_decodes requests in flight and always one long prompt queued.
        new = [
            self.make_request(rng.randint(64, 512), rng.randint(32, 96))
            for _ in range(self.num_decodes - sched.num_running - sched.num_waiting)
        ]
        if sched.num_waiting == 0:
            new.append(self.make_request(rng.randint(1000, 3000), rng.randint(32, 96)))
        return new


class FloodScenario(Scenario):
    """128 decodes running (4 tenants); one tenant keeps 512 requests waiting, three others
    a trickle: admission picks a tenant for every seat that frees."""

    FLOOD = Tenant("flood")
    OTHERS = (Tenant("a", weight=2.0), Tenant("b"), Tenant("c", weight=4.0))

    def __init__(self, fair: bool = False):
        super().__init__("flood", 16384, 128, 2048, seed=2, fair=fair)
        for i in range(128):
            self.add(self.rng.randint(64, 256), self.rng.randint(16, 64), self.OTHERS[i % 3])
        for _ in range(512):
            self.add(self.rng.randint(64, 256), self.rng.randint(16, 64), self.FLOOD)
        for _ in range(30):
            self.step()

    def arrivals(self) -> list[Request]:
        sched, rng = self.sched, self.rng
        new = [
            self.make_request(rng.randint(64, 256), rng.randint(16, 64), self.FLOOD)
            for _ in range(max(0, 512 - sched.waiting.num_queued("flood")))
        ]
        if rng.random() < 0.5:
            new.append(self.make_request(rng.randint(64, 256), 32, rng.choice(self.OTHERS)))
        return new


def cpu_busy_fraction(before: list[int], after: list[int]) -> float:
    """Whole-machine busy fraction between two /proc/stat samples (other load included)."""
    idle = (after[3] + after[4]) - (before[3] + before[4])
    total = sum(after) - sum(before)
    return 1.0 - idle / total if total else 0.0


def proc_stat() -> list[int]:
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return [0] * 10


def measure(make, steps: int, repeats: int) -> dict:
    """Medians over `repeats` fresh scenarios of `steps` timed steps each.

    The headline is this thread's CPU time: the machine's cores are shared, and other load
    stretches wall time (reported too, with the whole machine's busy fraction meanwhile).
    """
    cpu_req, wall_req, cpu_step, wall_step, running, tokens, busy = [], [], [], [], [], [], []
    for _ in range(repeats):
        scenario = make()
        s0 = proc_stat()
        cpu = wall = reqs = toks = 0
        for _ in range(steps):
            c, w, n, t = scenario.step()
            cpu, wall, reqs, toks = cpu + c, wall + w, reqs + n, toks + t
        busy.append(cpu_busy_fraction(s0, proc_stat()))
        cpu_step.append(cpu / steps / 1e3)
        wall_step.append(wall / steps / 1e3)
        cpu_req.append(cpu / max(reqs, 1) / 1e3)
        wall_req.append(wall / max(reqs, 1) / 1e3)
        running.append(reqs / steps)
        tokens.append(toks / steps)
    med = statistics.median
    return {
        "us_per_step": round(med(cpu_step), 1),
        "us_per_running_request": round(med(cpu_req), 3),
        "wall_us_per_step": round(med(wall_step), 1),
        "wall_us_per_running_request": round(med(wall_req), 3),
        "requests_per_step": round(med(running), 1),
        "tokens_per_step": round(med(tokens), 1),
        "us_per_running_request_all": [round(x, 3) for x in cpu_req],
        "machine_cpu_busy": [round(x, 2) for x in busy],
        "meets_goal": med(cpu_req) <= GOAL_US_PER_REQUEST,
    }


def machine() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model
            )
    except OSError:
        pass
    return {"host": platform.node(), "cpu": model, "cores": os.cpu_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--no-save", action="store_true", help="don't append to the results file")
    args = ap.parse_args()

    figures = {
        "decode_256": measure(DecodeScenario, args.steps, args.repeats),
        "prefill_mix": measure(PrefillMixScenario, args.steps, args.repeats),
        "decode_256_fair": measure(lambda: DecodeScenario(fair=True), args.steps, args.repeats),
        "prefill_mix_fair": measure(
            lambda: PrefillMixScenario(fair=True), args.steps, args.repeats
        ),
        "flood_fcfs": measure(FloodScenario, args.steps, args.repeats),
        "flood_fair": measure(lambda: FloodScenario(fair=True), args.steps, args.repeats),
    }
    ratios = {
        "decode_256": ("decode_256_fair", "decode_256"),
        "prefill_mix": ("prefill_mix_fair", "prefill_mix"),
        "flood": ("flood_fair", "flood_fcfs"),
    }
    fair_over_fcfs = {
        k: round(figures[a]["us_per_running_request"] / figures[b]["us_per_running_request"], 3)
        for k, (a, b) in ratios.items()
    }
    for name, f in figures.items():
        print(
            f"{name:12s} CPU {f['us_per_step']:8.1f} µs/step {f['us_per_running_request']:6.2f} "
            f"µs/request/step | wall {f['wall_us_per_step']:8.1f} µs/step "
            f"{f['wall_us_per_running_request']:6.2f} µs/request/step | "
            f"{f['requests_per_step']:.0f} requests, {f['tokens_per_step']:.0f} tokens/step, "
            f"goal <= {GOAL_US_PER_REQUEST} "
            f"µs/request, machine busy {max(f['machine_cpu_busy']):.0%}"
        )
    record = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "bench": "scheduler_overhead",
        "machine": machine(),
        "python": platform.python_version(),
        "steps": args.steps,
        "repeats": args.repeats,
        "figures": figures,
        "fair_over_fcfs_us_per_request": fair_over_fcfs,
    }
    print("fair / fcfs, µs per running request:", fair_over_fcfs)
    if not args.no_save:
        out = ROOT / "bench" / "results" / "scheduler_overhead.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"appended to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
