"""The default model's decode step with each way of multiplying bf16 rows by q4 groups.

csrc/quant_linear_q4g.c multiplies bf16 rows widened to fp32 (`off`), with VDPBF16PS
(`on`, AMD's default) or as exact int16 planes with VPDPWSSD (`i16`, Intel's default); the
choice is a runtime switch (`q4g_use_bf16_dot`), so both arms run in one process: greedy
`generate` calls of `--tokens` tokens at each batch size, the arms interleaved (the order
alternating every pair), on the default model as `make run` serves it (quantized, bf16
activations where the CPU computes bf16 natively). Reported per batch: ms a step (a call's
wall time over its tokens, its short prefill included) and the median of the pairs'
ratios, plus whether both arms produced the same tokens (they may not: the sums are
rounded differently). One JSON line per batch size goes to bench/results/q4_bf16_modes.jsonl
(`--no-write`: none).

    python bench/q4_bf16_modes.py                       # off vs i16, batches 1, 2, 4
    python bench/q4_bf16_modes.py --arms off,on --batches 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, base_record, log, write_jsonl  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Once upon a time, a little",
    "def fibonacci(n):",
    "In 1905, Albert Einstein",
]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arms", default="off,i16", help="two of off, on, i16")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    from engine import LLM, SamplingParams
    from engine.worker.kernels import quant
    from engine.worker.kernels.build import BF16_MODES

    names = args.arms.split(",")
    if len(names) != 2 or any(n not in BF16_MODES for n in names):
        ap.error(f"--arms: two of {sorted(BF16_MODES)}")
    llm = LLM(max_model_len=1024, kv_cache_gib=0.5, num_threads=args.threads)
    lib = quant.library()
    if lib is None:
        raise SystemExit("no kernel library: nothing to compare")
    start_mode = lib.q4g_bf16_native()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def run(name: str, batch: int) -> tuple[float, list]:
        lib.q4g_use_bf16_dot(BF16_MODES[name])
        prompts = (PROMPTS * (batch // len(PROMPTS) + 1))[:batch]
        t0 = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        ms = (time.perf_counter() - t0) / args.tokens * 1e3
        return ms, [list(o.outputs[0].token_ids) for o in out]

    for batch in (int(b) for b in args.batches.split(",")):
        for name in names:  # warm-up
            run(name, batch)
        ms: dict[str, list[float]] = {n: [] for n in names}
        ratios, same = [], True
        for i in range(args.pairs):
            order = names if i % 2 == 0 else names[::-1]
            got = {n: run(n, batch) for n in order}
            for n in names:
                ms[n].append(got[n][0])
            ratios.append(got[names[0]][0] / got[names[1]][0])
            same &= got[names[0]][1] == got[names[1]][1]
        rec = base_record("q4_bf16_modes")
        rec.update(
            batch=batch, tokens=args.tokens, pairs=args.pairs, threads=args.threads,
            arms=names, ms_per_step={n: round(statistics.median(v), 3) for n, v in ms.items()},
            ratio_first_over_second=round(statistics.median(ratios), 3),
            ratio_range=[round(min(ratios), 3), round(max(ratios), 3)], same_tokens=same,
        )  # fmt: skip
        log(
            f"batch {batch}: {names[0]} {rec['ms_per_step'][names[0]]} ms/step, {names[1]} "
            f"{rec['ms_per_step'][names[1]]} ms/step, {names[0]}/{names[1]} "
            f"{rec['ratio_first_over_second']} {rec['ratio_range']}, same tokens {same}"
        )
        if not args.no_write:
            write_jsonl(RESULTS_DIR / "q4_bf16_modes.jsonl", rec)
    lib.q4g_use_bf16_dot(start_mode)


if __name__ == "__main__":
    main()
