"""The copy task of issue 27: one greedy stream rewriting Python's own `textwrap` source.

Speculation pays most where the output repeats the input: a request to rewrite 1,600
characters of `textwrap.py` (the installed Python's, read from disk, so nothing is
downloaded) lets n-gram prompt lookup propose long runs that the target accepts. This
measures one stream on the default model (SmolLM2-135M-Instruct, dequantized, float32,
2 threads), ours without speculation against ours with each `--methods` entry:

- every method gets its own `LLM` in this one process (never two generating at once);
  one warm-up request each, then `--repeats` rounds, each round running the methods in an
  order rotated by the round, so all see the same drift in the box's load;
- TPOT = (last token time - first token time) / (tokens - 1) from the request's engine
  timestamps: decode time over tokens, which bursts of accepted tokens cannot hide; also
  TTFT and tok/s (tokens / wall time of the request);
- per method: the speculation counters over its timed runs (drafts, proposed, accepted,
  mean acceptance length, acceptance per position) and whether its greedy token ids equal
  the run without speculation (they must);
- `other_cores` per run (bench/common.py's LoadMeter): the box is shared.

vLLM CPU with its n-gram method is the peer of the issue's goal. It is not run here: this
script records whether its venv exists (bench/peers/setup_vllm.py --check), and the issue's
figures for it (12.6 tok/s without, 57.1 with n-gram, measured on an earlier session's box)
are quoted in docs/speculative.md as such, not as a same-run comparison.

One JSON line goes to bench/results/spec_copy.jsonl.

    python bench/spec_copy.py                            # ngram-k8, ngram, none; 3 rounds
    python bench/spec_copy.py --methods none,suffix --repeats 5
    python bench/spec_copy.py --quick                    # tiny model, 64 tokens, 1 round
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    LoadMeter,
    base_record,
    idle_snapshot,
    log,
    median,
    rnd,
    versions,
    write_jsonl,
)
from bench.workloads import ensure_model, model_info  # noqa: E402

SOURCE_CHARS = 1600
# Each method's `speculative_config` (vLLM's dict spelling); "none" runs without one.
METHODS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram-k8": {"method": "ngram", "num_speculative_tokens": 8},
    "ngram-k8-fixed": {"method": "ngram", "num_speculative_tokens": 8, "adaptive": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


def copy_messages(chars: int = SOURCE_CHARS) -> list[dict[str, str]]:
    """The chat request: rewrite the first `chars` characters of textwrap.py verbatim."""
    source = Path(textwrap.__file__).read_text()[:chars]
    prompt = (
        "Rewrite the following Python code exactly as it is, without any change:\n\n"
        f"```python\n{source}\n```"
    )
    return [{"role": "user", "content": prompt}]


def _spec_delta(before, after) -> dict[str, Any]:
    """The speculation counters between two `SpecDecodeStats` snapshots."""
    if after is None:
        return {}
    b_pos = list(before.accepted_per_pos) if before else []
    per_pos = [
        a - (b_pos[i] if i < len(b_pos) else 0) for i, a in enumerate(after.accepted_per_pos)
    ]
    drafts = after.num_drafts - (before.num_drafts if before else 0)
    proposed = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
    accepted = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
    return {
        "drafts": drafts,
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
        "mean_acceptance_length": rnd(1 + accepted / drafts, 3) if drafts else None,
        "acceptance_rate": rnd(accepted / proposed, 3) if proposed else None,
        # [i]: the share of drafts whose proposal at position i was accepted
        "accepted_per_pos": [rnd(x / drafts, 3) for x in per_pos] if drafts else [],
    }


def run_once(llm, prompt_ids: list[int], params) -> dict[str, Any]:
    with LoadMeter() as load:
        out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
    m, ids = out.metrics, list(out.outputs[0].token_ids)
    tpot = (m.last_token_time - m.first_token_time) / max(len(ids) - 1, 1)
    return {
        "ids": ids,
        "tokens": len(ids),
        "tpot_ms": tpot * 1e3,
        "ttft_s": m.first_token_time - m.arrival_time,
        "tok_s": len(ids) / load.wall_s,
        **load.as_dict(),
    }


def _summarize(record: dict[str, Any], runs, before, llms, tok) -> None:
    """Medians, greedy equality against the first run without speculation, the counters."""
    ref = runs["none"][0]["ids"] if runs["none"] else None
    if ref is not None:
        record["output_tokens"] = len(ref)
        record["output_head"] = tok.decode(ref[:40])
    for name, rs in runs.items():
        if not rs:
            continue
        record[name] = {
            "tpot_ms": rnd(median(x["tpot_ms"] for x in rs), 2),
            "tok_s": rnd(median(x["tok_s"] for x in rs), 2),
            "ttft_s": rnd(median(x["ttft_s"] for x in rs), 3),
            "runs": len(rs),
            "tokens_all": [x["tokens"] for x in rs],
            "tpot_ms_all": [rnd(x["tpot_ms"], 2) for x in rs],
            "other_cores_all": [x["other_cores"] for x in rs],
            "greedy_equal_to_none": None if ref is None else all(x["ids"] == ref for x in rs),
            **_spec_delta(before[name], llms[name].engine.stats().spec_decode),
        }
    if "none" in record:
        base = record["none"]["tpot_ms"]
        record["tpot_speedup_vs_none"] = {
            m: rnd(base / record[m]["tpot_ms"], 2) for m in runs if m != "none" and m in record
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--methods", default="ngram-k8,ngram,none", help=f"from {sorted(METHODS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--source-chars", type=int, default=SOURCE_CHARS)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="tiny model, 64 tokens, 1 round")
    ap.add_argument("--out", default=str(RESULTS_DIR / "spec_copy.jsonl"))
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.max_tokens, args.repeats = "tiny", 64, 1
        args.source_chars, args.max_model_len = 200, 512
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "none" not in methods:
        ap.error(f"--methods: none (the reference) and others from {sorted(METHODS)}")

    from bench.peers.setup_vllm import state as vllm_state
    from engine import LLM, SamplingParams

    record = base_record("spec_copy")
    record["idle_cores_before"] = idle_snapshot()
    model_dir = ensure_model(args.model)
    record["model"] = {"name": args.model, **model_info(model_dir)}
    record["settings"] = {
        "dtype": args.dtype, "threads": args.threads, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "source": f"textwrap.py[:{args.source_chars}] of Python "
        f"{sys.version.split()[0]}", "greedy": True,
        "speculative_configs": {m: METHODS[m] for m in methods},
    }  # fmt: skip
    record["versions"] = versions()
    llms = {}
    for name in methods:
        log(f"loading {name}")
        llms[name] = LLM(
            str(model_dir), dtype=args.dtype, device="cpu", num_threads=args.threads,
            max_model_len=args.max_model_len, kv_cache_gib=0.5, max_num_seqs=4,
            speculative_config=METHODS[name],
        )  # fmt: skip
    tok = llms["none"].tokenizer
    prompt_ids = tok.apply_chat_template(
        copy_messages(args.source_chars), add_generation_prompt=True
    )
    record["prompt_tokens"] = len(prompt_ids)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in llms.values():  # warm-up: kernels, first allocations
        llm.generate([{"prompt_token_ids": prompt_ids[:64]}], SamplingParams(max_tokens=8),
                     use_tqdm=False)  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    before = {m: llm.engine.stats().spec_decode for m, llm in llms.items()}
    before = {m: s.snapshot() if s else None for m, s in before.items()}
    for r in range(args.repeats):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        for name in order:
            res = run_once(llms[name], prompt_ids, params)
            log(f"round {r} {name}: {res['tokens']} tokens, TPOT {res['tpot_ms']:.1f} ms, "
                f"other_cores {res['other_cores']}")  # fmt: skip
            runs[name].append(res)
            _summarize(record, runs, before, llms, tok)
            # what a run cut short leaves: every finished run, summarized
            Path(args.out + ".partial.json").write_text(json.dumps(record, indent=1))
    vllm = vllm_state()
    record["vllm"] = {"ran": False, "installed": vllm["ok"],
                      "why": "not run by this script (see its docstring)" if vllm["ok"]
                      else (vllm["error"] or "")[:200]}  # fmt: skip
    for llm in llms.values():
        llm.close()
    write_jsonl(args.out, record)
    summary = {
        m: {
            k: record[m].get(k)
            for k in ("tpot_ms", "tok_s", "greedy_equal_to_none", "mean_acceptance_length")
        }
        for m in methods
    }
    print(json.dumps({"summary": summary, "speedup": record["tpot_speedup_vs_none"]}, indent=1))
    ok = all(record[m]["greedy_equal_to_none"] for m in methods)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
