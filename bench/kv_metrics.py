"""KV-cache efficiency of the paged cache: waste under W64, and concurrency for a fixed budget.

Both measurements drive the real `Scheduler` + `KVCacheManager` (pure Python, what the engine
uses) with a stand-in runner that samples token 7 for every request whose known tokens are all
computed; the allocation pattern is the engine's, only the model is missing. `--real` runs the
W64 waste measurement through a real `LLMEngine` instead (slower; tiny model by default), to
show the two agree.

1. KV waste under W64 (64 requests, prompts 32-256, 128 output tokens, all at once; pool =
   exactly the blocks W64 needs at its longest, unless --num-blocks). Sampled after every
   `schedule()` (the step's K/V slots are allocated and about to be written):
       allocated = blocks with a reference x block_size
       live      = sum of num_computed_tokens over running requests (tokens whose K/V is
                   or is being written)
   Reported over the run: waste_of_pool = mean((allocated - live) / pool slots) — the issue's
   definition — and the stricter waste_of_allocated = sum(allocated - live) /
   sum(allocated), plus both at the step of peak allocation. Goal: <= 4%.

2. Maximum concurrent sequences for a fixed KV budget (--budget-tokens, default 65,536 slots)
   with a stream of W64-shaped requests (--stream requests, queued at once, max_num_seqs
   unbounded): the peak and the mean number of running sequences while requests wait,
   against a contiguous reservation of max_model_len (--max-model-len, default 2,048) slots
   per sequence, budget // max_model_len. Also shown: a contiguous reservation of exactly
   prompt + max_tokens per request (the best a non-paged cache could do knowing every
   request's length up front). Goal: >= 3x the max-length reservation.

    python bench/kv_metrics.py            # both, a few seconds
    python bench/kv_metrics.py --quick    # smaller stream
    python bench/kv_metrics.py --real     # waste through LLMEngine on the tiny model too
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, base_record, log, write_jsonl  # noqa: E402
from bench.workloads import w64  # noqa: E402

GOAL_WASTE = 0.04
GOAL_CONCURRENCY = 3.0


class KVSampler:
    """Collects (allocated, live, running) after each schedule."""

    def __init__(self, kv: Any, sched: Any):
        self.kv, self.sched = kv, sched
        self.pool_slots = kv.num_blocks * kv.block_size
        self.alloc: list[int] = []
        self.live: list[int] = []
        self.running: list[int] = []
        self.waiting: list[int] = []

    def sample(self) -> None:
        kv = self.kv
        used = kv.num_blocks - kv.num_free_blocks
        self.alloc.append(used * kv.block_size)
        self.live.append(sum(r.num_computed_tokens for r in self.sched.running))
        self.running.append(len(self.sched.running))
        self.waiting.append(self.sched.num_waiting)

    def waste(self) -> dict[str, Any]:
        pairs = [(a, v) for a, v in zip(self.alloc, self.live, strict=True) if a > 0]
        if not pairs:
            return {}
        peak = max(range(len(pairs)), key=lambda i: pairs[i][0])
        pa, pv = pairs[peak]
        of_pool = statistics.mean((a - v) / self.pool_slots for a, v in pairs)
        of_alloc = sum(a - v for a, v in pairs) / sum(a for a, _ in pairs)
        return {
            "steps": len(pairs),
            "pool_slots": self.pool_slots,
            "waste_of_pool": round(of_pool, 5),
            "waste_of_allocated": round(of_alloc, 5),
            "peak_allocated_slots": pa,
            "peak_live_slots": pv,
            "peak_usage_of_pool": round(pa / self.pool_slots, 4),
            "waste_of_pool_at_peak": round((pa - pv) / self.pool_slots, 5),
            "waste_of_allocated_at_peak": round((pa - pv) / pa, 5),
        }


def fake_step(sched: Any, sampler: KVSampler | None, token: int = 7) -> None:
    from engine.core.step_io import RunnerOutput

    so = sched.schedule()
    if sampler is not None:
        sampler.sample()
    ids = []
    for rid in so.num_scheduled_tokens:
        req = sched.requests.get(rid)
        if req is not None and req.num_computed_tokens == len(req.all_token_ids):
            ids.append(rid)
    sched.update_from_output(so, RunnerOutput(req_ids=ids, sampled_token_ids=[[token]] * len(ids)))


def make_sched(num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
               max_model_len: int, prefix_caching: bool = True):  # fmt: skip
    from engine.config import SchedulerConfig
    from engine.core.kv_cache.manager import KVCacheManager
    from engine.core.scheduler import Scheduler

    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_queue_len=1 << 30
    )
    return Scheduler(cfg, kv, max_model_len), kv


def add_requests(sched: Any, prompts: list[list[int]], outs: list[int], prefix: str) -> None:
    from engine.core.request import Request
    from engine.sampling_params import SamplingParams

    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        sched.add_request(
            Request(f"{prefix}{i}", p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
        )


def w64_pool_blocks(prompts: list[list[int]], outs: list[int], block_size: int) -> int:
    return sum(math.ceil((len(p) + o) / block_size) for p, o in zip(prompts, outs, strict=True))


def waste_fake(args: argparse.Namespace) -> dict[str, Any]:
    wl = w64(32000, args.seed)
    blocks = args.num_blocks or w64_pool_blocks(wl.prompts, wl.max_tokens, args.block_size)
    sched, kv = make_sched(blocks, args.block_size, 256, args.max_num_batched_tokens, 4096)
    add_requests(sched, wl.prompts, wl.max_tokens, "w")
    sampler = KVSampler(kv, sched)
    while sched.has_unfinished_requests():
        fake_step(sched, sampler)
    return {"runner": "fake", "num_blocks": blocks, "block_size": args.block_size,
            "preemptions": sched.num_preemptions, **sampler.waste()}  # fmt: skip


def waste_real(args: argparse.Namespace) -> dict[str, Any]:
    from bench.workloads import ensure_model, model_info
    from engine import LLM, SamplingParams

    path = ensure_model(args.real_model)
    vocab = model_info(path)["vocab_size"]
    wl = w64(vocab, args.seed)
    blocks = args.num_blocks or w64_pool_blocks(wl.prompts, wl.max_tokens, args.block_size)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=blocks, block_size=args.block_size,
              max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
              num_threads=args.threads)  # fmt: skip
    eng = llm.engine
    sampler = KVSampler(eng.kv_manager, eng.scheduler)
    orig = eng.scheduler.schedule

    def schedule(*a: Any, **kw: Any) -> Any:
        so = orig(*a, **kw)
        sampler.sample()
        return so

    eng.scheduler.schedule = schedule
    t0 = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": p} for p in wl.prompts],
        SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
        use_tqdm=False,
    )
    return {"runner": f"real ({args.real_model})", "num_blocks": blocks,
            "block_size": args.block_size, "preemptions": eng.scheduler.num_preemptions,
            "wall_s": round(time.perf_counter() - t0, 2), **sampler.waste()}  # fmt: skip


def concurrency(args: argparse.Namespace) -> dict[str, Any]:
    bs = args.block_size
    blocks = args.budget_tokens // bs
    wl = w64(32000, args.seed + 1, num_requests=args.stream)
    sched, kv = make_sched(blocks, bs, 1 << 20, args.max_num_batched_tokens, args.max_model_len)
    add_requests(sched, wl.prompts, wl.max_tokens, "c")
    sampler = KVSampler(kv, sched)
    while sched.has_unfinished_requests():
        fake_step(sched, sampler)
    # Steady state: steps where requests were still waiting (the pool is the limit).
    busy = [r for r, w in zip(sampler.running, sampler.waiting, strict=True) if w > 0]
    mean_len = statistics.mean(len(p) + o for p, o in zip(wl.prompts, wl.max_tokens, strict=True))
    contiguous_max = args.budget_tokens // args.max_model_len
    contiguous_exact = int(args.budget_tokens // mean_len)
    paged_mean = statistics.mean(busy) if busy else statistics.mean(sampler.running)
    paged_peak = max(sampler.running)
    return {
        "budget_tokens": args.budget_tokens,
        "block_size": bs,
        "stream_requests": args.stream,
        "mean_seq_len": round(mean_len, 1),
        "max_model_len": args.max_model_len,
        "paged_peak_running": paged_peak,
        "paged_mean_running_while_queued": round(paged_mean, 1),
        "preemptions": sched.num_preemptions,
        "steps": len(sampler.running),
        "contiguous_max_len_seqs": contiguous_max,
        "contiguous_exact_len_seqs": contiguous_exact,
        "ratio_mean_vs_max_len": round(paged_mean / max(contiguous_max, 1), 2),
        "ratio_peak_vs_max_len": round(paged_peak / max(contiguous_max, 1), 2),
        "ratio_mean_vs_exact_len": round(paged_mean / max(contiguous_exact, 1), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="W64 pool (default: W64's need)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--budget-tokens", type=int, default=65536, help="KV budget for concurrency")
    ap.add_argument("--max-model-len", type=int, default=2048, help="contiguous reservation")
    ap.add_argument("--stream", type=int, default=2048, help="requests in the concurrency stream")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true", help="also measure W64 waste via LLMEngine")
    ap.add_argument("--real-model", default="tiny", help="model for --real (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="stream of 512 requests")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "kv_metrics.jsonl")
    args = ap.parse_args()
    if args.quick:
        args.stream = min(args.stream, 512)

    rec = base_record("kv_metrics")
    t0 = time.perf_counter()
    rec["waste_w64"] = [waste_fake(args)]
    if args.real:
        log("W64 waste through LLMEngine ...")
        rec["waste_w64"].append(waste_real(args))
    rec["concurrency"] = concurrency(args)
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    w = rec["waste_w64"][0]
    c = rec["concurrency"]
    rec["goals"] = {
        "waste_of_pool<=4%": w.get("waste_of_pool", 1) <= GOAL_WASTE,
        "waste_of_allocated<=4%": w.get("waste_of_allocated", 1) <= GOAL_WASTE,
        "concurrency>=3x": c["ratio_mean_vs_max_len"] >= GOAL_CONCURRENCY,
    }
    for item in rec["waste_w64"]:
        print(f"W64 KV waste [{item['runner']}]: {100 * item['waste_of_pool']:.2f}% of pool "
              f"(mean over {item['steps']} steps), {100 * item['waste_of_allocated']:.2f}% of "
              f"allocated; at peak ({100 * item['peak_usage_of_pool']:.1f}% of pool in use): "
              f"{100 * item['waste_of_allocated_at_peak']:.2f}% of allocated; "
              f"preemptions {item['preemptions']}")  # fmt: skip
    print(f"Concurrency for {c['budget_tokens']} KV slots: paged mean {c['paged_mean_running_while_queued']} "
          f"(peak {c['paged_peak_running']}) running vs {c['contiguous_max_len_seqs']} with a "
          f"{c['max_model_len']}-slot reservation = {c['ratio_mean_vs_max_len']}x "
          f"(vs {c['contiguous_exact_len_seqs']} with exact prompt+max_tokens reservations: "
          f"{c['ratio_mean_vs_exact_len']}x); preemptions {c['preemptions']}")  # fmt: skip
    print(f"goals: {rec['goals']}")
    if not args.no_write:
        write_jsonl(args.out, rec)
        log(f"appended to {args.out}")


if __name__ == "__main__":
    main()
