"""Offline throughput at tensor_parallel_size 1 and 2 on the CPU, and whether they agree.

On one CPU the two ranks of TP=2 share the same cores (each rank gets half the threads,
`runtime.num_threads // 2`) and add two all-reduces per layer plus the logits gather, so
this is a correctness check of tensor parallelism with its cost on the CPU, not a speed-up:
TP pays off where each rank has a device (or a socket) of its own.

Each TP size runs in its own subprocess (`LLM.generate`, every request submitted at once):
one warm-up run, then `--repeats` timed runs; tok/s = generated tokens / wall time. The
greedy token ids of the TP=2 run are compared with TP=1's, sequence by sequence. One JSON
line goes to bench/results/tp_throughput.jsonl.

    python bench/tp_throughput.py                         # llama50m, 32 requests, 64 tokens
    python bench/tp_throughput.py --model micro --requests 64 --output-len 128
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

from bench.common import LoadMeter, base_record, idle_snapshot, median, write_jsonl  # noqa: E402
from bench.workloads import ensure_model, model_info, w64  # noqa: E402


def child(args: argparse.Namespace) -> None:
    """One TP size: prints {"tok_s": [...], "ids": [...]} as its last line."""
    from engine import LLM, SamplingParams

    model_dir = ensure_model(args.model)
    llm = LLM(
        str(model_dir), tensor_parallel_size=args.child, dtype=args.dtype, device="cpu",
        num_threads=args.threads, kv_cache_gib=args.kv_gib, max_model_len=args.max_model_len,
        max_num_seqs=args.requests,
    )  # fmt: skip
    wl = w64(llm.engine.vocab_size, seed=args.seed, num_requests=args.requests,
             output_len=args.output_len)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up: kernels, first allocations
    tok_s, loads, ids = [], [], []
    for _ in range(args.repeats):
        with LoadMeter() as load:  # this process and its TP worker are "own"
            outs = llm.generate(prompts, params, use_tqdm=False)
        tok_s.append(sum(len(o.outputs[0].token_ids) for o in outs) / load.wall_s)
        loads.append(load.as_dict())
        ids = [o.outputs[0].token_ids for o in outs]
    llm.close()
    print(json.dumps({"tok_s": tok_s, "loads": loads, "ids": ids}))


def run_size(args: argparse.Namespace, tp: int) -> dict:
    cmd = [sys.executable, __file__, "--child", str(tp)] + [
        a for k, v in vars(args).items() if k not in ("child", "out")
        for a in (f"--{k.replace('_', '-')}", str(v))
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"TP={tp} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama50m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in all (TP=2: half each)")
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tp_throughput.jsonl"))
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    record = base_record("tp_throughput")
    record["idle_cores_before"] = idle_snapshot()
    record["model"] = {"name": args.model, **model_info(ensure_model(args.model))}
    record["settings"] = {k: v for k, v in vars(args).items() if k not in ("child", "out")}
    runs = {tp: run_size(args, tp) for tp in (1, 2)}
    same = sum(a == b for a, b in zip(runs[1]["ids"], runs[2]["ids"], strict=True))
    for tp, r in runs.items():
        record[f"tp{tp}"] = {
            "tok_s": round(median(r["tok_s"]), 1),
            "tok_s_all": [round(x, 1) for x in r["tok_s"]],
            # own: this TP size's processes (rank 0 and its workers); other: the rest of
            # the box. TP=2's ranks wait on each other, so they leave room for other jobs.
            "own_cores_all": [x["own_cores"] for x in r["loads"]],
            "other_cores_all": [x["other_cores"] for x in r["loads"]],
        }
    record["tp2_over_tp1"] = round(record["tp2"]["tok_s"] / record["tp1"]["tok_s"], 3)
    record["greedy_sequences_equal"] = f"{same}/{args.requests}"
    write_jsonl(args.out, record)
    print(json.dumps({k: record[k] for k in ("tp1", "tp2", "tp2_over_tp1",
                                              "greedy_sequences_equal")}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
