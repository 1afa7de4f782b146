"""The step cost model of the adaptive speculation rule, measured: F in t(N) = c (F + N).

`engine/core/spec/adaptive.py` weighs an extra verified token against a step's fixed cost F
(`speculative.step_fixed_cost_tokens`, in units of one more token's compute). This measures
it on this machine: one request at a time computes N new tokens behind a cached context
(a prompt = a 256-token prefix already in the prefix cache + N fresh random tokens, so the
step is what a verify step of 1 + k = N tokens at context 256 costs), for N in `--sizes`;
the step's time is first_token_time - first_scheduled_time (one step: the prefix hit leaves
only the N tokens). Medians over `--repeats` per N, then a least-squares line t = a + b N:
F = a / b. Each size's repeats are interleaved with the others' (round-robin), so load drift
hits every N alike; `other_cores` is recorded.

One JSON line goes to bench/results/spec_cost.jsonl.

    python bench/spec_cost.py                  # the default model, float32, 2 threads
    python bench/spec_cost.py --quick          # tiny model, 2 repeats
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, LoadMeter, base_record, log, median, rnd, write_jsonl  # noqa: E402
from bench.workloads import ensure_model, model_info  # noqa: E402

PREFIX = 256


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sizes", default="1,2,3,5,9,17,33")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS_DIR / "spec_cost.jsonl"))
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.repeats = "tiny", 2
    from engine import LLM, SamplingParams

    sizes = [int(s) for s in args.sizes.split(",")]
    model_dir = ensure_model(args.model)
    llm = LLM(str(model_dir), dtype=args.dtype, device="cpu", num_threads=args.threads,
              max_model_len=512, kv_cache_gib=0.25, max_num_seqs=4)  # fmt: skip
    vocab = llm.engine.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(100, vocab) for _ in range(PREFIX)]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([{"prompt_token_ids": prefix}], one, use_tqdm=False)  # fills the prefix cache
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with LoadMeter() as load:
        for _ in range(args.repeats):
            for n in sizes:
                ids = prefix + [rng.randrange(100, vocab) for _ in range(n)]
                m = llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)[0].metrics
                if m.num_cached_tokens != PREFIX:
                    raise RuntimeError(f"prefix not cached: {m.num_cached_tokens} of {PREFIX}")
                times[n].append(m.first_token_time - m.first_scheduled_time)
    llm.close()
    med = {n: median(ts) for n, ts in times.items()}
    a, b = fit_line([float(n) for n in sizes], [med[n] for n in sizes])
    record = base_record("spec_cost")
    record["model"] = {"name": args.model, **model_info(model_dir)}
    record["settings"] = {"dtype": args.dtype, "threads": args.threads, "context": PREFIX,
                          "sizes": sizes, "repeats": args.repeats}  # fmt: skip
    record["step_ms"] = {str(n): rnd(med[n] * 1e3, 2) for n in sizes}
    record["step_ms_all"] = {str(n): [rnd(t * 1e3, 2) for t in ts] for n, ts in times.items()}
    record["fit_ms"] = {"a": rnd(a * 1e3, 3), "b_per_token": rnd(b * 1e3, 3)}
    record["step_fixed_cost_tokens"] = rnd(a / b, 1)
    record.update(load.as_dict())
    write_jsonl(args.out, record)
    log(f"F = {record['step_fixed_cost_tokens']} (other_cores {record['other_cores']})")
    print(json.dumps({k: record[k] for k in ("step_ms", "fit_ms", "step_fixed_cost_tokens",
                                              "other_cores")}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
