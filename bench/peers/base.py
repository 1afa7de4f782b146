"""The protocol between bench/throughput.py and one engine's subprocess. Standard library only.

The parent writes a spec JSON and runs `python bench/peers/<engine>_peer.py SPEC OUT`. The
peer loads the model once and warms up, then prints `@@BENCH READY {...}` and waits for
commands on stdin, one per line:

    run R      time repeat R of the workload; answers `@@BENCH RESULT {run record}`
    quit       stop, clean up, write OUT and exit

so the parent can keep every engine loaded and interleave their repeats (ours, vLLM,
transformers, ours, ...): on a shared machine the load drifts, and ratios from neighbouring
runs are fairer than ratios from runs minutes apart. A failure prints `@@BENCH ERROR {...}`.
OUT holds the summary:

    {"engine": ..., "ok": true, "versions": {...}, "load_s": ..., "threads": ...,
     "runs": [{"repeat", "wall_s", "gen_tokens", "tok_s", "other_cores", "own_cores", ...}],
     "first_output_ids": [...]}                    # repeat 0's first request (cross-check)

or {"ok": false, "error": "..."} (the traceback is in "error").

Spec keys: model (dir), dtype (float32 or bfloat16; the weights are cast on load), vocab_size,
prompts (token-id lists), max_tokens (per request), warmup_prompts, repeats, threads,
max_num_seqs, max_num_batched_tokens, kv_cache_gib, max_model_len, batch_size (transformers),
extra (engine-specific dict).

Repeat r > 0 changes each prompt's first token (deterministically), so no engine can serve
a later repeat's prompts from the prefix cache filled by an earlier one; the lengths, and
so the work, stay the same.

    python bench/peers/ours_peer.py SPEC OUT < /dev/null   # runs all repeats, no commands
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import LoadMeter, versions  # noqa: E402

SENTINEL = "@@BENCH"
# setup(spec, result) loads and warms up, fills result (load_s, threads, settings, ...) and
# returns run_repeat(r) -> run record; a record may carry "_first_ids" (repeat 0 only).
Setup = Callable[[dict[str, Any], dict[str, Any]], Callable[[int], dict[str, Any]]]


def prompts_for_repeat(spec: dict[str, Any], r: int) -> list[list[int]]:
    prompts = spec["prompts"]
    if r == 0:
        return [list(p) for p in prompts]
    vocab = int(spec["vocab_size"])
    lo = 100 if vocab > 400 else 1
    span = vocab - lo
    return [[((p[0] - lo + r) % span) + lo, *p[1:]] for p in prompts]


def greedy_params_and_warm_up(
    llm: Any, sampling_params: type, spec: dict[str, Any], result: dict[str, Any]
) -> list[Any]:
    """Per-request greedy params (ignore_eos, the spec's max tokens) for an `LLM` with a
    vLLM-style `generate`, after a short warm-up on the spec's warm-up prompts (its time in
    result["warmup_s"]). `sampling_params` is the engine's own SamplingParams class."""
    params = [
        sampling_params(temperature=0, max_tokens=int(m), ignore_eos=True)
        for m in spec["max_tokens"]
    ]
    warm = spec.get("warmup_prompts") or []
    if warm:
        t0 = time.perf_counter()
        llm.generate(
            [{"prompt_token_ids": p} for p in warm],
            sampling_params(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        result["warmup_s"] = round(time.perf_counter() - t0, 2)
    return params


def embedding_runner(
    embed: Callable[[list[dict[str, Any]]], list[Any]], spec: dict[str, Any],
    result: dict[str, Any],
) -> Callable[[int], dict[str, Any]]:  # fmt: skip
    """For bench/embeddings.py: warms up `embed` (a vLLM-style `LLM.embed` over
    `{"prompt_token_ids": ...}` prompts, returning outputs with `.outputs.embedding`) on the
    spec's warm-up prompts, and returns run_repeat(r): every input at once, its record's
    "tokens" the prompt tokens embedded, repeat 0's first 16 floats in `_first_ids`."""
    warm = spec.get("warmup_prompts") or []
    if warm:
        t0 = time.perf_counter()
        embed([{"prompt_token_ids": p} for p in warm])
        result["warmup_s"] = round(time.perf_counter() - t0, 2)

    def run_repeat(r: int) -> dict[str, Any]:
        prompts = [{"prompt_token_ids": p} for p in prompts_for_repeat(spec, r)]
        holder: dict[str, Any] = {}

        def run() -> int:
            holder["outs"] = embed(prompts)
            return sum(len(p["prompt_token_ids"]) for p in prompts)

        rec = timed(run)
        rec["inputs_s"] = round(len(prompts) / rec["wall_s"], 2) if rec["wall_s"] else None
        if r == 0:
            first = holder["outs"][0].outputs.embedding
            rec["_first_ids"] = [round(float(x), 6) for x in list(first)[:16]]
        return rec

    return run_repeat


def timed(fn: Callable[[], int]) -> dict[str, Any]:
    """Run fn (returns generated tokens) under a LoadMeter; the run's record."""
    with LoadMeter() as m:
        gen = fn()
    cpu_s = m.own_cores * m.wall_s  # CPU time of this peer's process tree (all threads)
    return {
        "wall_s": round(m.wall_s, 4),
        "gen_tokens": gen,
        "tok_s": round(gen / m.wall_s, 2) if m.wall_s > 0 else None,
        "cpu_s": round(cpu_s, 2),
        # Tokens per CPU-second used: less sensitive to other tenants than tok/s, but it
        # counts OpenMP spin-waiting as work, so it is a secondary figure.
        "tok_per_cpu_s": round(gen / cpu_s, 2) if cpu_s > 0 else None,
        **m.as_dict(),
    }


def emit(kind: str, payload: dict[str, Any]) -> None:
    """One protocol line on the real stdout (a single write: stays whole in the pipe)."""
    out = sys.__stdout__
    out.write(f"\n{SENTINEL} {kind} {json.dumps(payload)}\n")
    out.flush()


def peer_main(engine: str, setup: Setup, cleanup: Callable[[], None] | None = None) -> None:
    """argv: SPEC OUT. Runs the command loop; exceptions become ok=false, never a hang."""
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(f"usage: {Path(sys.argv[0]).name} SPEC.json OUT.json   (run by bench/throughput.py)")
        print(__doc__)
        sys.exit(0 if len(sys.argv) == 2 else 2)
    spec = json.loads(Path(sys.argv[1]).read_text())
    result: dict[str, Any] = {"engine": engine, "ok": False, "pid": os.getpid()}
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        result["versions"] = versions()
        run_repeat = setup(spec, result)
        emit("READY", {k: result.get(k) for k in ("load_s", "warmup_s", "threads")})

        def one(r: int) -> None:
            rec = run_repeat(r)
            first = rec.pop("_first_ids", None)
            if first is not None:
                result["first_output_ids"] = first
            rec = {"repeat": r, **rec}
            runs.append(rec)
            emit("RESULT", rec)
            print(f"{engine} repeat {r}: {rec['tok_s']} tok/s, other cores {rec['other_cores']}",
                  file=sys.stderr, flush=True)  # fmt: skip

        commanded = False
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            commanded = True
            if cmd[0] == "run":
                one(int(cmd[1]))
            elif cmd[0] == "quit":
                break
        if not commanded:  # stdin closed at once (run by hand): all repeats in a row
            for r in range(int(spec["repeats"])):
                one(r)
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, not swallowed
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-6000:]}"
        emit("ERROR", {"error": result["error"]})
    if cleanup is not None:
        try:
            cleanup()
        except BaseException:  # noqa: BLE001 - best effort
            pass
    result["runs"] = runs
    result["total_s"] = round(time.perf_counter() - t0, 2)
    Path(sys.argv[2]).write_text(json.dumps(result))
    # Hard exit: some engines leave non-daemon threads or child processes behind (the parent
    # also kills this process's session when it is done).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)
