"""When every seat is held by a flooding tenant and another tenant arrives: wait for a seat,
or preempt one of the flood's requests (`scheduler.preempt_for_fairness`)? Both costs,
measured on the scheduler alone (issue 31), in engine steps, so no clock and no load on
the box moves them.

A flood: tenant A keeps `--flood-queue` requests waiting (prompt `--prompt-len` tokens,
`--output-len` output tokens, ignore_eos), so its requests hold all `--seats` seats and,
admitted together, free their seats in waves. Tenant B (the same weight) sends one request
of the same shape at random gaps (mean `--gap` steps) for `--steps` steps. A fake runner
samples a token for every request whose tokens are all computed. Once per setting
(`preempt_for_fairness` off; on swapping whenever due, `preempt_for_fairness_wait_steps`
0; on with the default wait of 1 step for a seat that frees by itself; the same with
prefix caching off, the victim's worst case: all it computed is recomputed), the same
arrivals:

- the starved tenant's cost: B's wait, steps from its arrival to its first scheduled step
  (p50, p99, max), and its requests' whole time in steps (p50, p99);
- the victim's cost: preemptions per B arrival; tokens recomputed (positions computed once
  already and scheduled again: what the prefix cache did not restore); the victims' extra
  steps (a preempted request's time in steps minus the median of those never preempted);
- the engine's: tokens scheduled per step and A's generated tokens per step.

Prints the figures and appends one JSON line to bench/results/preempt_for_fairness.jsonl.

    python bench/preempt_for_fairness.py [--steps 4000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, base_record, write_jsonl  # noqa: E402
from engine.config import SchedulerConfig  # noqa: E402
from engine.core.kv_cache.manager import KVCacheManager  # noqa: E402
from engine.core.policy.tenant import Tenant  # noqa: E402
from engine.core.request import Request  # noqa: E402
from engine.core.scheduler import Scheduler  # noqa: E402
from engine.core.step_io import RunnerOutput, SchedulerOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
A, B = Tenant("A"), Tenant("B")


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else None


def runner_output(sched: Scheduler, so: SchedulerOutput) -> RunnerOutput:
    ids = []
    for rid in so.num_scheduled_tokens:
        req = sched.requests.get(rid)
        if req is not None and req.num_computed_tokens == len(req.all_token_ids):
            ids.append(rid)
    return RunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids])


def b_arrivals(args: argparse.Namespace) -> list[int]:
    """The steps at which B sends (the same for both settings)."""
    rng = random.Random(args.seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / args.gap)
        if t >= args.steps:
            return out
        out.append(int(t))


def run(
    args: argparse.Namespace,
    preempt: bool,
    arrivals: list[int],
    prefix_caching: bool = True,
    wait_steps: int = 1,
) -> dict[str, Any]:
    cfg = SchedulerConfig(
        max_num_seqs=args.seats, max_num_batched_tokens=args.budget, policy="fair",
        max_queue_len=100_000, preempt_for_fairness=preempt,
        preempt_for_fairness_wait_steps=wait_steps,
    )  # fmt: skip
    kv = KVCacheManager(args.num_blocks, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    sched = Scheduler(cfg, kv, 4096)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    ids = iter(range(10**9))
    arrived: dict[str, int] = {}
    first: dict[str, int] = {}
    done: dict[str, int] = {}
    high_water: dict[str, int] = {}  # the highest position computed so far, per request
    preempted: set[str] = set()
    recomputed = scheduled = a_generated = 0
    pending = list(reversed(arrivals))

    def add(tenant: Tenant, now: int) -> None:
        i = next(ids)
        rid = f"{tenant.name}{i}"
        prompt = list(range((i + 1) * 10_000, (i + 1) * 10_000 + args.prompt_len))
        sched.add_request(Request(rid, prompt, params, arrival_time=float(now), tenant=tenant))
        arrived[rid] = now

    for now in range(args.steps + 2000):  # then drain: every B request finishes
        if now < args.steps:
            while sched.waiting.num_queued("A") < args.flood_queue:
                add(A, now)
            while pending and pending[-1] <= now:
                pending.pop()
                add(B, now)
        elif not any(r.startswith("B") and r not in done for r in arrived):
            break
        so = sched.schedule()
        preempted |= so.preempted_req_ids
        starts = {d.request_id: d.num_computed_tokens for d in so.scheduled_new_reqs}
        starts |= {d.request_id: d.num_computed_tokens for d in so.scheduled_cached_reqs}
        for rid, n in so.num_scheduled_tokens.items():
            start = starts[rid]
            hw = high_water.get(rid, 0)
            recomputed += max(0, min(start + n, hw) - start)
            high_water[rid] = max(hw, start + n)
            scheduled += n
            first.setdefault(rid, now)
        out = runner_output(sched, so)
        a_generated += sum(r.startswith("A") for r in out.req_ids)
        for req in sched.update_from_output(so, out):
            done[req.request_id] = now
    steps = min(now + 1, args.steps)
    b = [r for r in arrived if r.startswith("B")]
    b_wait = [first[r] - arrived[r] for r in b]
    b_e2e = [done[r] - arrived[r] + 1 for r in b if r in done]
    a_done = [r for r in done if r.startswith("A") and arrived[r] < args.steps]
    plain = [done[r] - first[r] + 1 for r in a_done if r not in preempted]
    victims = [done[r] - first[r] + 1 for r in a_done if r in preempted]
    base = statistics.median(plain) if plain else 0
    return {
        "preempt_for_fairness": preempt,
        "wait_steps": wait_steps if preempt else None,
        "prefix_caching": prefix_caching,
        "b_requests": len(b),
        "b_wait_steps_p50": pct(b_wait, 50),
        "b_wait_steps_p99": pct(b_wait, 99),
        "b_wait_steps_max": max(b_wait, default=None),
        "b_e2e_steps_p50": pct(b_e2e, 50),
        "b_e2e_steps_p99": pct(b_e2e, 99),
        "preemptions": len(preempted),
        "preemptions_per_b_arrival": round(len(preempted) / max(1, len(b)), 2),
        "tokens_recomputed": recomputed,
        "tokens_recomputed_per_preemption": round(recomputed / max(1, len(preempted)), 1),
        "victim_extra_steps_p50": pct([v - base for v in victims], 50),
        "victim_extra_steps_p99": pct([v - base for v in victims], 99),
        "a_plain_steps_median": base,
        "tokens_scheduled_per_step": round(scheduled / (now + 1), 2),
        "a_generated_per_step": round(a_generated / steps, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--seats", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--flood-queue", type=int, default=64)
    ap.add_argument("--gap", type=float, default=50.0, help="mean steps between B's arrivals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    arrivals = b_arrivals(args)
    runs = {
        "off": run(args, False, arrivals),
        "on_wait0": run(args, True, arrivals, wait_steps=0),
        "on": run(args, True, arrivals),
        "on_no_prefix_cache": run(args, True, arrivals, prefix_caching=False),
    }
    for name, r in runs.items():
        print(f"preempt_for_fairness {name}: {json.dumps(r)}")
    if not args.no_save:
        record = {**base_record("preempt_for_fairness"), "settings": vars(args), "runs": runs}
        write_jsonl(RESULTS_DIR / "preempt_for_fairness.jsonl", record)
        print("appended to bench/results/preempt_for_fairness.jsonl")


if __name__ == "__main__":
    main()
