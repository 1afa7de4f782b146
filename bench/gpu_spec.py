"""The speculative phase of scripts/gpu_check.sh: verify steps on FlashInfer, with graphs on.

    python bench/gpu_spec.py --work DIR [--dry-run]

On the device: a tiny checkpoint with head_dim 128 (the kernels the jit phase built), bf16,
FlashInfer, CUDA graphs captured for decode buckets. Greedy output with n-gram speculation
and with a draft model (the checkpoint's first layer) against the output without, on 16
prompts. A verify step (1 + k query tokens per request) runs FlashInfer's prefill-style
plan eagerly; the decode graphs replay only one-token steps. In bf16 two runs that batch
differently may flip a near-tie, so a divergent sequence must diverge where the
reference's top-2 logprob margin is under `NEAR_TIE`; anything else fails the phase. The
dry run (CPU, float32, torch backend) requires exact equality.

Writes DIR/spec.json; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NEAR_TIE = 0.1  # bf16 logits of two batchings differ by up to ~1e-2 here
MAX_NEW = 48


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(4, 24))] for _ in range(16)]


def _run(llm, prompts) -> tuple[list, float]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs], time.perf_counter() - t0


def _compare(ref: list, got: list, exact: bool) -> dict[str, Any]:
    """Sequences equal; else where each diverges and the reference's margin there."""
    equal, ties = 0, []
    for r, g in zip(ref, got, strict=True):
        if r.token_ids == g.token_ids:
            equal += 1
            continue
        pairs = zip(r.token_ids, g.token_ids, strict=False)  # a length difference diverges too
        i = next(
            (j for j, (a, b) in enumerate(pairs) if a != b), min(len(r.token_ids), len(g.token_ids))
        )
        top = r.logprobs[i].top if i < len(r.token_ids) else []
        margin = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
        ties.append({"position": i, "margin": round(margin, 4)})
    res: dict[str, Any] = {"equal": equal, "of": len(ref), "divergences": ties}
    bad = [t for t in ties if exact or t["margin"] >= NEAR_TIE]
    if bad:
        raise RuntimeError(f"speculative output differs beyond a near-tie: {res}")
    return res


def phase_spec(dry: bool) -> dict[str, Any]:
    from bench.spec_draft import write_truncated_copy
    from engine import LLM
    from tests.support.tiny_models import make_tiny_checkpoint

    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "tiny", "llama", hidden_size=256,
                                    num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                                    weight_std=0.05)  # fmt: skip
        draft = write_truncated_copy(path, Path(tmp) / "draft", 1)
        kw: dict[str, Any] = dict(
            max_model_len=256, block_size=16, num_kv_blocks=512, max_num_seqs=16,
            device="cpu" if dry else "cuda", dtype="float32" if dry else "bfloat16",
        )  # fmt: skip
        prompts = _prompts()
        base = LLM(str(path), **kw)
        res["attention_backend"] = base.engine.accelerator.attention_backend
        res["decode_graphs"] = base.engine.accelerator.decode_graphs
        if not dry and (res["attention_backend"] != "flashinfer" or not res["decode_graphs"]):
            raise RuntimeError(f"expected FlashInfer with decode graphs: {base.engine.accelerator}")
        ref, t_ref = _run(base, prompts)
        res["seconds_without"] = round(t_ref, 2)
        del base
        methods = {
            "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
            "draft": {"model": str(draft), "num_speculative_tokens": 3, "adaptive": False},
        }
        for name, spec in methods.items():
            llm = LLM(str(path), speculative_config=spec, **kw)
            got, seconds = _run(llm, prompts)
            stats = llm.engine.stats()
            s = stats.spec_decode
            entry = _compare(ref, got, exact=dry)
            entry.update(seconds=round(seconds, 2), drafts=s.num_drafts,
                         draft_tokens=s.num_draft_tokens, accepted=s.num_accepted_tokens,
                         mean_acceptance_length=round(s.mean_acceptance_length or 0.0, 3),
                         blocks_held_at_idle=stats.num_blocks - stats.num_free_blocks)  # fmt: skip
            if not s.num_draft_tokens > s.num_accepted_tokens > 0:
                raise RuntimeError(f"{name}: proposals not both accepted and rejected: {entry}")
            if entry["blocks_held_at_idle"]:
                raise RuntimeError(f"{name}: KV blocks held at idle: {entry}")
            res[name] = entry
            del llm
    res["verify_steps"] = "eager, FlashInfer prefill plan (graphs replay 1-token decode steps)"
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, float32, torch backend")
    args = ap.parse_args(argv)
    res = phase_spec(args.dry_run)
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "spec.json").write_text(json.dumps(res, indent=1, sort_keys=True))
    print(json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
