"""The copy task of issue 27: one greedy stream rewriting Python's own `textwrap` source.

Speculation pays most where the output repeats the input: a request to rewrite 1,600
characters of `textwrap.py` (the installed Python's, read from disk, so nothing is
downloaded) lets n-gram prompt lookup propose long runs that the target accepts. This
measures one stream on the default model (SmolLM2-135M-Instruct, its GGUF dequantized to a
float32 safetensors checkpoint by bench/float_checkpoint.py, which both engines read; 2 threads), ours without speculation against ours with each `--methods` entry:

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

vLLM CPU with its n-gram method is the peer of the issue's goal, run in the same invocation
(bench/spec_copy_vllm.py): one subprocess per `--vllm-methods` entry under the vLLM venv's
python (bench/peers/setup_vllm.py installs it on first use unless --no-install), the same
checkpoint directory and prompt token ids, its repeats in the same rotated order as ours
(entries `vllm-none`, `vllm-ngram`), TPOT by the same definition (bench/peers/spec_timing.py),
its own speculation counters, and its output compared with ours. A vLLM that cannot be
installed or refuses to run is recorded under "vllm" with the error, and ours still runs.

One JSON line goes to bench/results/spec_copy.jsonl.

    python bench/spec_copy.py                            # ngram-k8, ngram, none; vLLM none, ngram
    python bench/spec_copy.py --methods none,ngram,ngram-l4 --vllm-methods none,ngram
    python bench/spec_copy.py --vllm-methods ""          # ours only
    python bench/spec_copy.py --methods none,suffix --repeats 5
    python bench/spec_copy.py --methods none,ngram,suffix,draft-q4 --vllm-methods ""
    python bench/spec_copy.py --quick                    # tiny model, 64 tokens, 1 round
"""

from __future__ import annotations

import argparse
import atexit
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
from bench.float_checkpoint import smollm2_float_dir  # noqa: E402
from bench.spec_copy_vllm import VLLM_METHODS, entry_name, summarize  # noqa: E402
from bench.workloads import ensure_model, model_info  # noqa: E402

SOURCE_CHARS = 1600
# Each method's `speculative_config` (vLLM's dict spelling); "none" runs without one.
METHODS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    # vLLM's n-gram as it resolves its settings (a lookup of exactly 4: min = max)
    "ngram-l4": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 4,
        "prompt_lookup_max": 4,
    },
    "ngram-k8": {"method": "ngram", "num_speculative_tokens": 8},
    "ngram-k8-fixed": {"method": "ngram", "num_speculative_tokens": 8, "adaptive": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    # The default model's own 4-bit GGUF drafting for its float32 release (same tokenizer,
    # ~5x fewer bytes per token); the path is filled in by `speculative_config`.
    "draft-q4": {"method": "draft", "num_speculative_tokens": 4, "draft_model": None},
}


def speculative_config(name: str) -> dict[str, Any] | None:
    """METHODS[name], the q4 draft's path filled in: the default model's GGUF (so
    `draft-q4` drafts for the smollm2 float32 checkpoint only)."""
    cfg = METHODS[name]
    if cfg is None or cfg.get("method") != "draft":
        return cfg
    from engine.worker.models.default_model import default_model_gguf

    return {**cfg, "draft_model": str(default_model_gguf())}


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


def _summarize_vllm(record: dict[str, Any], runs, vruns) -> None:
    """The vLLM entries, their output against ours without speculation, and the headline:
    TPOT ratios of vLLM's to ours (above 1: ours is faster per token)."""
    ours_none = runs["none"][0]["ids"] if runs["none"] else None
    vllm_none = vruns.get(entry_name("none")) or []
    vllm_none_ids = vllm_none[0]["ids"] if vllm_none else None
    for name, rs in vruns.items():
        if rs:
            record[name] = summarize(rs, ours_none, vllm_none_ids)
    pairs = [("none", entry_name("none")), ("ngram", entry_name("ngram")),
             ("ngram-l4", entry_name("ngram"))]  # fmt: skip
    ratio = {}
    for ours, theirs in pairs:
        a, b = record.get(ours, {}).get("tpot_ms"), record.get(theirs, {}).get("tpot_ms")
        if a and b:
            ratio[f"{theirs}/{ours}"] = rnd(b / a, 2)
    record["tpot_vllm_over_ours"] = ratio


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
    ap.add_argument(
        "--vllm-methods",
        default="none,ngram",
        help=f"vLLM CPU peers from {sorted(VLLM_METHODS)}; empty: ours only",
    )
    ap.add_argument("--vllm-python", default=None, help="a python with vllm (default: the venv)")
    ap.add_argument("--no-install", action="store_true", help="never install the vLLM venv")
    ap.add_argument("--vllm-timeout", type=int, default=1800, help="seconds per vLLM command")
    ap.add_argument("-v", "--verbose", action="store_true", help="echo the vLLM peers' output")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.max_tokens, args.repeats = "tiny", 64, 1
        args.source_chars, args.max_model_len = 200, 512
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "none" not in methods:
        ap.error(f"--methods: none (the reference) and others from {sorted(METHODS)}")
    vllm_methods = [m for m in args.vllm_methods.split(",") if m]
    if any(m not in VLLM_METHODS for m in vllm_methods):
        ap.error(f"--vllm-methods: from {sorted(VLLM_METHODS)}")

    from bench import spec_copy_vllm
    from bench.throughput import _kill_live_peers
    from engine import LLM, SamplingParams

    atexit.register(_kill_live_peers)  # a vLLM peer's engine-core must not outlive us

    record = base_record("spec_copy")
    record["idle_cores_before"] = idle_snapshot()
    # smollm2: the GGUF dequantized to float32 safetensors, which vLLM reads as ours does
    model_dir = smollm2_float_dir() if args.model == "smollm2" else ensure_model(args.model)
    record["model"] = {"name": args.model, **model_info(model_dir)}
    record["settings"] = {
        "dtype": args.dtype, "threads": args.threads, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "source": f"textwrap.py[:{args.source_chars}] of Python "
        f"{sys.version.split()[0]}", "greedy": True,
        "speculative_configs": {m: speculative_config(m) for m in methods},
        "vllm_speculative_configs": {entry_name(m): VLLM_METHODS[m] for m in vllm_methods},
    }  # fmt: skip
    record["versions"] = versions()
    llms = {}
    for name in methods:
        log(f"loading {name}")
        llms[name] = LLM(
            str(model_dir), dtype=args.dtype, device="cpu", num_threads=args.threads,
            max_model_len=args.max_model_len, kv_cache_gib=0.5, max_num_seqs=4,
            speculative_config=speculative_config(name),
        )  # fmt: skip
    tok = llms["none"].tokenizer
    prompt_ids = tok.apply_chat_template(
        copy_messages(args.source_chars), add_generation_prompt=True
    )
    record["prompt_tokens"] = len(prompt_ids)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    peers, vllm_failed = {}, {}
    if vllm_methods:
        log(f"starting vLLM peers {vllm_methods} (load and compile: a minute or more)")
        peers, vllm_failed = spec_copy_vllm.start_peers(vllm_methods, model_dir, prompt_ids, args)
    for llm in llms.values():  # warm-up: kernels, first allocations
        llm.generate([{"prompt_token_ids": prompt_ids[:64]}], SamplingParams(max_tokens=8),
                     use_tqdm=False)  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    vruns: dict[str, list[dict[str, Any]]] = {name: [] for name in peers}
    before = {m: llm.engine.stats().spec_decode for m, llm in llms.items()}
    before = {m: s.snapshot() if s else None for m, s in before.items()}
    entries = methods + list(peers)
    for r in range(args.repeats):
        order = entries[r % len(entries) :] + entries[: r % len(entries)]
        for name in order:
            if name in peers:
                if not peers[name].alive:
                    continue
                res = peers[name].run(r)
                if res is None:
                    vllm_failed[name] = peers[name].error or "no result"
                    continue
                vruns[name].append(res)
            else:
                res = run_once(llms[name], prompt_ids, params)
                runs[name].append(res)
            log(f"round {r} {name}: {res['tokens']} tokens, TPOT {rnd(res['tpot_ms'], 1)} ms, "
                f"other_cores {res['other_cores']}")  # fmt: skip
            _summarize(record, runs, before, llms, tok)
            _summarize_vllm(record, runs, vruns)
            # what a run cut short leaves: every finished run, summarized
            Path(args.out + ".partial.json").write_text(json.dumps(record, indent=1))
    for llm in llms.values():
        llm.close()
    record["vllm"] = {"methods": [entry_name(m) for m in vllm_methods], "failed": vllm_failed}
    for name, p in peers.items():
        res = spec_copy_vllm.finish(p, vllm_failed, name)
        record["vllm"][name] = {k: res.get(k) for k in ("load_s", "warmup_s", "settings",
                                                        "versions", "tpot_source")}  # fmt: skip
    record["vllm"]["ran"] = any(vruns.values())
    write_jsonl(args.out, record)
    summary = {
        m: {
            k: record[m].get(k)
            for k in (
                "tpot_ms",
                "tok_s",
                "greedy_equal_to_none",
                "equal_to_ours_none",
                "mean_acceptance_length",
            )
        }
        for m in entries
        if m in record
    }
    for name in vllm_failed:
        log(f"vLLM {name} FAILED: {vllm_failed[name][-600:]}")
    print(
        json.dumps(
            {
                "summary": summary,
                "speedup": record["tpot_speedup_vs_none"],
                "tpot_vllm_over_ours": record.get("tpot_vllm_over_ours"),
            },
            indent=1,
        )
    )
    ok = all(record[m]["greedy_equal_to_none"] for m in methods)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
