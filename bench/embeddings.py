"""Embedding throughput, ours against vLLM's pooling runner, side by side in one invocation.

The checkpoint is the default family's (Llama): `llama50m` (bench/workloads.py, random
weights) with sentence-transformers files written beside it (`modules.json`, last-token
pooling, Normalize), as decoder embedding checkpoints ship; both engines read the same
files and pool the same way. The workload: `--inputs` token-id inputs, lengths uniform in
[`--min-len`, `--max-len`] (seeded), every input submitted at once through each engine's
offline `LLM.embed`; repeat r > 0 changes each input's first token (no engine may serve a
repeat from a cache). Each engine runs in its own process (bench/peers/ours_embed_peer.py,
bench/peers/vllm_embed_peer.py, the vLLM venv from bench/peers/setup_vllm.py), loads and
warms up, then the repeats are interleaved (round r rotates the order) so both see the same
drift in the shared machine's load. Throughput is prompt tokens embedded per second of wall
time, medians over repeats; the ratio ours/vLLM comes from the medians (goal >= 1.25).
Same dtype, threads, KV size, max_num_seqs, max_num_batched_tokens and max_model_len for
both. Every run records the other processes' CPU use (bench/common.py). One JSON line per
invocation goes to bench/results/embeddings.jsonl; the first input's first 16 floats of
each engine are kept to show they compute the same vectors.

    python bench/embeddings.py                       # llama50m, 256 inputs of 32-512 tokens, 3 repeats
    python bench/embeddings.py --engines ours --quick
    python bench/embeddings.py --dtype bfloat16 --inputs 512
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, base_record, log, rnd, versions, write_jsonl  # noqa: E402  # noqa: E402
from bench.throughput import _kill_live_peers, peer_python, run_engines  # noqa: E402
from bench.throughput_record import summarize  # noqa: E402
from bench.workloads import MIN_TOKEN_ID, MODELS_DIR, ensure_model, model_info  # noqa: E402

SCRIPTS = {
    "ours": ROOT / "bench" / "peers" / "ours_embed_peer.py",
    "vllm": ROOT / "bench" / "peers" / "vllm_embed_peer.py",
}
GOAL = 1.25


def embedding_model(base: str) -> Path:
    """`base`'s checkpoint with last-token, normalized sentence-transformers pooling files
    beside it (built once, next to the base model in the bench cache)."""
    src = ensure_model(base)
    out = MODELS_DIR / f"{Path(base).name}-embed"
    if (out / "modules.json").exists():
        return out
    tmp = MODELS_DIR / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    hidden = json.loads((tmp / "config.json").read_text())["hidden_size"]
    (tmp / "1_Pooling").mkdir()
    (tmp / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True, "include_prompt": True,
    }))  # fmt: skip
    (tmp / "2_Normalize").mkdir()
    (tmp / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (tmp / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 2048, "do_lower_case": False})
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def make_inputs(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)
    ]


def max_abs_diff(a: list[float] | None, b: list[float] | None) -> float | None:
    if not a or not b:
        return None
    return round(max(abs(x - y) for x, y in zip(a, b, strict=False)), 7)


def main() -> None:
    atexit.register(_kill_live_peers)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama50m", help="base checkpoint (bench/workloads.py)")
    ap.add_argument("--engines", default="ours,vllm")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-gib", type=float, default=2.0, help="KV cache GiB for ours and vLLM")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per engine subprocess")
    ap.add_argument("--no-install", action="store_true", help="never install the vLLM venv")
    ap.add_argument("--vllm-python", default=None, help="python of an existing vLLM CPU venv")
    ap.add_argument("--sequential", action="store_true", help="one engine after the other")
    ap.add_argument("--quick", action="store_true", help="32 inputs of 16-64 tokens, 1 repeat")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "embeddings.jsonl")
    ap.add_argument("--no-write", action="store_true", help="print only, write no JSONL")
    ap.add_argument("-v", "--verbose", action="store_true", help="echo the peers' output")
    args = ap.parse_args()
    args.ours_extra = "{}"
    if args.quick:
        args.inputs, args.min_len, args.max_len, args.repeats = 32, 16, 64, 1
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    model = embedding_model(args.model)
    info = model_info(model)
    inputs = make_inputs(args.inputs, args.min_len, args.max_len, info["vocab_size"], args.seed)
    spec: dict[str, Any] = {
        "model": str(model), "dtype": args.dtype, "vocab_size": info["vocab_size"],
        "prompts": inputs, "warmup_prompts": inputs[:8], "repeats": args.repeats,
        "threads": args.threads, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_gib": args.kv_gib,
        "max_model_len": args.max_model_len,
    }  # fmt: skip
    pythons = {e: peer_python(e, args) for e in engines}
    label = f"embed {Path(args.model).name} {args.dtype}"
    raw = run_engines(engines, pythons, spec, args, label, scripts=SCRIPTS)
    results = {e: summarize(r) for e, r in raw.items()}
    for e, r in results.items():
        runs = raw[e].get("runs") or []
        if runs:
            r["inputs_s_all"] = [x.get("inputs_s") for x in runs]
    ratios, goals = {}, {}
    ours, vllm = results.get("ours", {}), results.get("vllm", {})
    if ours.get("ok") and vllm.get("ok") and vllm.get("tok_s"):
        ratios["ours/vllm"] = round(ours["tok_s"] / vllm["tok_s"], 3)
        ratios["ours/vllm best"] = round(ours["tok_s_best"] / vllm["tok_s_best"], 3)
        goals["ours/vllm"] = {"target": GOAL, "met": ratios["ours/vllm"] >= GOAL}
    rec = base_record("embeddings")
    rec.update({
        "model": Path(args.model).name, "model_info": info, "dtype": args.dtype,
        "workload": {"inputs": args.inputs, "min_len": args.min_len, "max_len": args.max_len,
                     "prompt_tokens": sum(map(len, inputs)), "seed": args.seed},
        "settings": {k: spec[k] for k in ("repeats", "threads", "max_num_seqs",
                     "max_num_batched_tokens", "kv_cache_gib", "max_model_len")},
        "versions": {"host": versions(), **{e: r.get("versions") for e, r in results.items()}},
        "engines": results, "ratios": ratios, "goals": goals,
        "first_vector_max_abs_diff_vs_ours": {
            e: max_abs_diff(raw.get("ours", {}).get("first_output_ids"), r.get("first_output_ids"))
            for e, r in raw.items() if e != "ours"
        },
    })  # fmt: skip
    for e, r in results.items():
        if r.get("ok"):
            log(f"{e}: {r['tok_s']} tok/s median ({r['tok_s_all']}), other cores "
                f"{r['other_cores_all']}")  # fmt: skip
        else:
            log(f"{e}: FAILED: {(r.get('error') or '')[:500]}")
    log(f"ratios: {ratios}  first-vector diff: {rec['first_vector_max_abs_diff_vs_ours']}")
    if not args.no_write:
        write_jsonl(args.out, rec)
        log(f"wrote {args.out}")
    print(json.dumps({"ratios": ratios, "tok_s": {e: rnd(r.get("tok_s"), 1)
                      for e, r in results.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
