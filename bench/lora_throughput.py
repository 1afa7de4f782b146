"""Decode throughput with LoRA adapters vs the base model on the same batch (issue 18).

One engine per dtype (`LLM(enable_lora=True, max_loras=4, max_lora_rank=16)`) runs the same
`--batch` requests (random prompts of 32-64 tokens, `--output-len` greedy tokens, EOS
ignored, all at once) three ways, interleaved `--repeats` times:

  base      no request names an adapter (the LoRA-enabled engine on the base model)
  lora      the requests spread round-robin over `--adapters` rank-`--rank` adapters on
            all seven projections (q/k/v/o, gate/up/down): every decode step mixes them all
  lora_off  a second engine with LoRA off, the same batch (what LoRA support itself costs)

Only decode-only steps are timed (`StepSplit` around `LLMEngine.step`); the figure is
decode tokens/s, median over repeats, and the goal is lora >= 0.8 x base. The ratio of the
median decode step (batch / median step time, median over repeats) is reported beside it:
a neighbour's burst moves it far less. The adapters are
random PEFT directories written once under the bench cache (the engine reads them as it
would any PEFT adapter).

    python bench/lora_throughput.py                  # smollm2, float32 and bfloat16, batch 64
    python bench/lora_throughput.py --dtypes float32 --repeats 5
    python bench/lora_throughput.py --quick          # tiny model, batch 16, a smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    CACHE_DIR,
    RESULTS_DIR,
    LoadMeter,
    base_record,
    log,
    median,
    versions,
    write_jsonl,
)
from bench.peers.ours_peer import StepSplit  # noqa: E402
from bench.workloads import ensure_model, model_info  # noqa: E402

GOAL = 0.8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, info: dict[str, Any], rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter on every projection of every layer, as PEFT saves one."""
    import torch
    from safetensors.torch import save_file

    if (out / "adapter_model.safetensors").exists():
        return out
    h, hd, inter = info["hidden_size"], info["head_dim"], info["intermediate_size"]
    q, kv = info["num_heads"] * hd, info["num_kv_heads"] * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(info["num_layers"]):
        for proj, (fan_in, fan_out) in shapes.items():
            block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "target_modules": list(TARGETS), "bias": "none", "use_rslora": False,
              "task_type": "CAUSAL_LM"}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out


def make_llm(path: Path, dtype: str, args: argparse.Namespace, lora: bool):
    from engine import LLM

    extra = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank) if lora else {}
    return LLM(
        str(path), dtype=dtype, kv_cache_gib=args.kv_gib, max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
        max_model_len=512, **extra,
    )  # fmt: skip


class DecodeSteps:
    """StepSplit's totals plus each decode-only step's wall time: the median step is far
    less moved by a neighbour's burst than the total is."""

    def __init__(self, engine: Any):
        self.split = StepSplit(engine)
        if not self.split.ok:
            raise RuntimeError("cannot time engine steps (LLMEngine.step moved)")
        self.times: list[float] = []
        inner = engine.step

        def step(*a: Any, **kw: Any) -> Any:
            before = self.split.decode_steps
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            if self.split.decode_steps > before:
                self.times.append(time.perf_counter() - t0)
            return out

        engine.step = step

    def reset(self) -> None:
        self.split.reset()
        self.times = []


def decode_run(llm, steps: DecodeSteps, prompts, params, loras) -> dict[str, Any]:
    steps.reset()
    with LoadMeter() as meter:
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    d = steps.split.as_dict()
    step_s = median(steps.times)
    d["median_step_ms"] = round(1e3 * step_s, 2)
    d["median_step_tok_s"] = round(d["mean_decode_batch"] / step_s, 1)
    return {**d, **meter.as_dict()}


def measure(path: Path, info: dict[str, Any], dtype: str, args) -> dict[str, Any]:
    from engine import LoRARequest, SamplingParams

    rng = random.Random(args.seed)
    lo = 100 if info["vocab_size"] > 400 else 3
    prompts = [
        {"prompt_token_ids": [rng.randrange(lo, info["vocab_size"])
                              for _ in range(rng.randint(32, 64))]}
        for _ in range(args.batch)
    ]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    adapter_root = CACHE_DIR / "lora-adapters" / path.name
    loras = [
        LoRARequest(f"r{args.rank}-{i}", i + 1,
                    str(write_adapter(adapter_root / f"r{args.rank}-{i}", info, args.rank, i)))
        for i in range(args.adapters)
    ]  # fmt: skip
    per_request = [loras[i % len(loras)] for i in range(args.batch)]
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "lora": [], "lora_off": []}
    llm = make_llm(path, dtype, args, lora=True)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:8], warm, use_tqdm=False, lora_request=per_request[:8])
    steps = DecodeSteps(llm.engine)
    for r in range(args.repeats):
        for mode, with_loras in (("base", None), ("lora", per_request)):
            runs[mode].append(decode_run(llm, steps, prompts, params, with_loras))
            _log_run(dtype, mode, r, runs[mode][-1])
    del llm
    off = make_llm(path, dtype, args, lora=False)
    off.generate(prompts[:8], warm, use_tqdm=False)
    steps = DecodeSteps(off.engine)
    for r in range(args.repeats):
        runs["lora_off"].append(decode_run(off, steps, prompts, params, None))
        _log_run(dtype, "lora_off", r, runs["lora_off"][-1])
    tok_s = {mode: median(x["decode_tok_s"] for x in rs) for mode, rs in runs.items()}
    step_tok_s = {mode: median(x["median_step_tok_s"] for x in rs) for mode, rs in runs.items()}
    return {
        "dtype": dtype, "runs": runs, "decode_tok_s": tok_s, "median_step_tok_s": step_tok_s,
        "lora_vs_base": round(tok_s["lora"] / tok_s["base"], 3),
        "lora_vs_base_median_step": round(step_tok_s["lora"] / step_tok_s["base"], 3),
        "base_vs_lora_off": round(tok_s["base"] / tok_s["lora_off"], 3),
        "other_cores_max": max(x["other_cores"] for rs in runs.values() for x in rs),
    }  # fmt: skip


def _log_run(dtype: str, mode: str, r: int, run: dict[str, Any]) -> None:
    log(f"  {dtype} {mode} #{r}: {run['decode_tok_s']} tok/s, median step "
        f"{run['median_step_ms']} ms (other cores {run['other_cores']})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny model, fp32, batch 16")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "lora_throughput.jsonl")
    args = ap.parse_args()
    if args.quick:
        args.model, args.dtypes, args.batch, args.output_len, args.rank = (
            "tiny", "float32", 16, 16, 8
        )  # fmt: skip
        args.repeats = 1
    path = ensure_model(args.model)
    info = model_info(path)
    for dtype in args.dtypes.split(","):
        log(
            f"{args.model} {dtype}: decode batch {args.batch}, {args.adapters} adapters r{args.rank}"
        )
        res = measure(path, info, dtype, args)
        t = res["decode_tok_s"]
        print(f"{args.model} {dtype}: base {t['base']} tok/s, {args.adapters} x r{args.rank} "
              f"adapters {t['lora']} tok/s = {res['lora_vs_base']:.2f}x base (goal >= {GOAL}: "
              f"{'met' if res['lora_vs_base'] >= GOAL else 'NOT met'}; by median step "
              f"{res['lora_vs_base_median_step']:.2f}x); LoRA off {t['lora_off']} tok/s; "
              f"other cores up to {res['other_cores_max']}")  # fmt: skip
        rec = base_record("lora_throughput")
        rec.update({"model": args.model, "model_info": info, "versions": versions(),
                    "batch": args.batch, "adapters": args.adapters, "rank": args.rank,
                    "output_len": args.output_len, "threads": args.threads, "goal": GOAL,
                    "goal_met": res["lora_vs_base"] >= GOAL, **res})  # fmt: skip
        if not args.no_write:
            write_jsonl(args.out, rec)
    if not args.no_write:
        log(f"appended to {args.out}")


if __name__ == "__main__":
    main()
