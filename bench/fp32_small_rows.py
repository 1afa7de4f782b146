"""fp32 decode at 1-4 rows: MKL's GEMV below 4 rows (the Intel rule) against oneDNN's packed
weight from one row (the rule elsewhere), on the same machine (issue 26).

engine/worker/models/cpu_linear.py picks the crossover by CPU vendor; this measures both
rules here whatever the vendor, by setting the crossover before each engine is built.
Offline `LLM.generate` of the float32 SmolLM2 checkpoint (bench/float_checkpoint.py),
`--batch` sizes, 48 greedy tokens per run after a warm-up, the median of 3 runs per engine;
each (batch, rule) built `--rounds` times, rules interleaved. Each engine is built and run
on a thread of its own (as the server steps it). One JSON line goes to
bench/results/fp32_small_rows.jsonl.

    python bench/fp32_small_rows.py            # ~6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, LoadMeter, base_record, log, write_jsonl  # noqa: E402
from bench.float_checkpoint import smollm2_float_dir  # noqa: E402

TOKENS = 48


def step_ms(model: str, rows_rule: int, batch: int, threads: int) -> float:
    """Median ms per decode step of `batch` sequences with fp32 F.linear below `rows_rule`."""
    import engine.worker.models.cpu_linear as cpu_linear
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    cpu_linear._fp32_small_rows = lambda: rows_rule  # the vendor rule, overridden
    llm = LLM(model=model, dtype="float32", quantization="none", num_threads=threads)
    prompts = [
        {"prompt_token_ids": list(range(1000 + 50 * i, 1064 + 50 * i))} for i in range(batch)
    ]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append((time.perf_counter() - t0) / TOKENS)
    return statistics.median(times) * 1e3


def on_thread(fn, *args) -> float:
    out: list[float] = []
    th = threading.Thread(target=lambda: out.append(fn(*args)))
    th.start()
    th.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = str(smollm2_float_dir())
    rows: dict[str, dict[str, list[float]]] = {}
    with LoadMeter() as load:
        for batch in (int(b) for b in args.batches.split(",")):
            for _ in range(args.rounds):
                for rule in (4, 1):
                    ms = on_thread(step_ms, model, rule, batch, args.threads)
                    rows.setdefault(f"batch_{batch}", {}).setdefault(
                        f"mkl_below_{rule}", []
                    ).append(round(ms, 2))
                    log(f"batch {batch}, F.linear below {rule} rows: {ms:.1f} ms/step")
    record = {**base_record("fp32_small_rows"), "settings": vars(args), "ms_per_step": rows,
              "load": load.as_dict()}  # fmt: skip
    write_jsonl(RESULTS_DIR / "fp32_small_rows.jsonl", record)
    log("appended to bench/results/fp32_small_rows.jsonl")


if __name__ == "__main__":
    main()
