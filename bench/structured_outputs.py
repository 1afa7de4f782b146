"""Structured outputs: the per-step grammar mask cost at batch 64 against a decode step.

Three measurements, on the default model (SmolLM2-135M-Instruct, 49,152 tokens):

1. mask: 64 requests, each with its own JSON Schema (64 distinct grammars, variants of the
   test corpus), stepped together: per step the batch bitmask is filled by llguidance
   (`fill_bitmask`), applied to [64, V] logits (`apply_bitmask`), a token is taken from the
   masked logits and every matcher advances. Reported: ms per step for fill, apply,
   advance and their sum.
2. decode: `LLM.generate` of 64 unconstrained requests (ignore_eos, fixed length): ms per
   decode step at batch 64 and tokens/s. The goal is mask/decode <= 10 %.
3. constrained: the same 64 requests, each with its schema: tokens/s, to compare.

    python bench/structured_outputs.py --quick   # fewer steps and shorter generations
    python bench/structured_outputs.py

One JSON line goes to bench/results/structured_outputs.jsonl.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

BATCH = 64
RESULTS = Path(__file__).parent / "results" / "structured_outputs.jsonl"


def schemas(n: int) -> list[dict]:
    """`n` distinct schemas: the corpus's, with bounds varied per copy."""
    from tests.support.schemas import JSON_SCHEMAS

    out = []
    for i in range(n):
        s = copy.deepcopy(JSON_SCHEMAS[i % len(JSON_SCHEMAS)][1])
        s["title"] = f"{s.get('title', 'S')}{i}"
        s.setdefault("properties", {})
        if "properties" in s and "oneOf" not in s:
            s["properties"][f"extra{i}"] = {"type": "integer", "minimum": 0, "maximum": 10 + i}
        out.append(s)
    return out


def bench_mask(llm, specs, steps: int) -> dict:
    from llguidance import LLExecutor

    from engine.worker.structured.bitmask import apply_bitmask, fill_bitmask

    eng = llm.engine
    t0 = time.perf_counter()
    grammars = [eng.grammars.compile(s) for s in specs]
    compile_s = time.perf_counter() - t0
    matchers = [g.new_matcher() for g in grammars]
    ex = LLExecutor()
    eos = sorted(eng.tokenizer.eos_token_ids)
    vocab = eng.vocab_size
    gen = torch.Generator().manual_seed(0)
    t_fill = t_apply = t_adv = 0.0
    for _ in range(steps):
        logits = torch.randn(BATCH, vocab, generator=gen)
        a = time.perf_counter()
        mask = fill_bitmask(
            ex, list(enumerate(matchers)), BATCH, vocab, grammars[0].eos_token_id, eos
        )
        b = time.perf_counter()
        apply_bitmask(logits, mask, list(range(BATCH)))
        c = time.perf_counter()
        toks = logits.argmax(dim=-1).tolist()
        d = time.perf_counter()
        for i, (m, t) in enumerate(zip(matchers, toks, strict=True)):
            if m.is_stopped() or t in eos:
                matchers[i] = grammars[i].new_matcher()  # a new request takes the slot
            else:
                m.consume_token(t)
        e = time.perf_counter()
        t_fill, t_apply, t_adv = t_fill + b - a, t_apply + c - b, t_adv + e - d
    ms = 1000.0 / steps
    return {
        "compile_64_s": round(compile_s, 3),
        "fill_ms": round(t_fill * ms, 3),
        "apply_ms": round(t_apply * ms, 3),
        "advance_ms": round(t_adv * ms, 3),
        "mask_total_ms": round((t_fill + t_apply + t_adv) * ms, 3),
    }


def bench_generate(llm, prompts, params) -> dict:
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
    steps = max(len(c.token_ids) for o in outs for c in o.outputs)
    return {"tokens": toks, "wall_s": round(wall, 3), "tok_per_s": round(toks / wall, 1),
            "ms_per_step": round(1000 * wall / steps, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams, StructuredOutputsParams

    steps, gen_len = (20, 16) if args.quick else (100, 64)
    llm = LLM(max_num_seqs=BATCH, max_model_len=512, num_threads=args.threads)
    specs = [StructuredOutputsParams(json=s) for s in schemas(BATCH)]
    mask = bench_mask(llm, specs, steps)
    prompts = [f"Give me record number {i} as JSON." for i in range(BATCH)]
    free = [SamplingParams(max_tokens=gen_len, ignore_eos=True, seed=i) for i in range(BATCH)]
    decode = bench_generate(llm, prompts, free)
    constrained = bench_generate(
        llm, prompts,
        [SamplingParams(max_tokens=gen_len, seed=i, structured_outputs=s)
         for i, s in enumerate(specs)],
    )  # fmt: skip
    row = {
        "bench": "structured_outputs", "quick": args.quick, "batch": BATCH,
        "vocab": llm.engine.vocab_size, "threads": args.threads, "mask": mask,
        "decode_unconstrained": decode, "decode_constrained": constrained,
        "mask_over_decode_step": round(mask["mask_total_ms"] / decode["ms_per_step"], 4),
    }  # fmt: skip
    print(json.dumps(row, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
