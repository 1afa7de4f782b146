"""Page faults and system time of W64 with and without `runtime.malloc_keep_mib`.

Each arm runs in its own process (the setting is process-wide and cannot be undone), the
arms alternating `--pairs` times: our engine loads llama50m, warms up, then runs W64
(`LLM.generate`, 64 requests of 32-256 fresh prompt tokens, 128 greedy tokens each)
`--runs` times, recording per run the wall time, the minor page faults and the user and
system CPU seconds (`getrusage`). Fresh prompts every run, so the prefix cache never
serves a prompt. Wall time on a shared box drifts by more than this setting moves it;
faults and system time are the measure. One JSON line per arm and pair goes to
bench/results/malloc_keep.jsonl (`--no-write`: none).

    python bench/malloc_keep.py                 # bf16, 4 pairs x 3 runs
    python bench/malloc_keep.py --dtype float32 --pairs 2
    python bench/malloc_keep.py --output-len 1 --runs 6     # prefill alone
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, base_record, log, write_jsonl  # noqa: E402

# One arm: argv = model dir, dtype, malloc_keep_mib, runs, threads, output tokens. Prints one
# JSON line.
_ARM = """
import json, resource, sys, time
from engine import LLM, SamplingParams
from bench.workloads import w64
path, dtype, keep, runs, threads, out_len = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
llm = LLM(path, dtype=dtype, kv_cache_gib=3.0, max_num_seqs=256, max_num_batched_tokens=2048,
          max_model_len=2048, num_threads=threads, malloc_keep_mib=keep)
vocab = llm.engine.vocab_size
def run(wl):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.max_tokens]
    llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
warm = w64(vocab, 999, num_requests=8, output_len=8)
run(warm)
out = []
for i in range(runs):
    wl = w64(vocab, 100 + i, output_len=out_len)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    run(wl)
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    out.append({"wall_s": round(dt, 3), "minor_faults": r1.ru_minflt - r0.ru_minflt,
                "user_s": round(r1.ru_utime - r0.ru_utime, 3),
                "sys_s": round(r1.ru_stime - r0.ru_stime, 3),
                "tok_s": round(sum(wl.max_tokens) / dt, 1)})
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--keep-mib", type=int, default=1024, help="the tuned arm's value")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="W64 runs per process")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--output-len", type=int, default=128, help="tokens per request (1: prefill alone)"
    )
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    from bench.workloads import ensure_model

    model = ensure_model("llama50m")
    for pair in range(args.pairs):
        for keep in (0, args.keep_mib):
            proc = subprocess.run(
                [sys.executable, "-c", _ARM, str(model), args.dtype, str(keep), str(args.runs),
                 str(args.threads), str(args.output_len)],
                cwd=ROOT, capture_output=True, text=True, check=True,
            )  # fmt: skip
            runs = json.loads(proc.stdout.strip().splitlines()[-1])
            rec = base_record("malloc_keep")
            rec.update(
                model="llama50m", workload="w64" if args.output_len == 128 else
                f"w64-o{args.output_len}", dtype=args.dtype, threads=args.threads,
                pair=pair, malloc_keep_mib=keep, runs=runs,
            )  # fmt: skip
            log(
                f"pair {pair} malloc_keep_mib={keep:5d}: faults "
                f"{[r['minor_faults'] for r in runs]}, sys {[r['sys_s'] for r in runs]} s, "
                f"wall {[r['wall_s'] for r in runs]} s"
            )
            if not args.no_write:
                write_jsonl(RESULTS_DIR / "malloc_keep.jsonl", rec)


if __name__ == "__main__":
    main()
