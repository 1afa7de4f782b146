"""vLLM's CPU build on an embedding workload: its pooling runner. Runs under the vLLM
venv's python (bench/peers/setup_vllm.py), started by bench/embeddings.py in its own process.

`vllm.LLM(model, runner="pooling", dtype, max_model_len, max_num_seqs,
max_num_batched_tokens, seed=0)`: vLLM reads the checkpoint's sentence-transformers
pooling files as we do (last token, normalized). The KV cache size comes from
`VLLM_CPU_KVCACHE_SPACE` and the threads from `VLLM_CPU_OMP_THREADS_BIND` (set by the
parent). Then `embed([{"prompt_token_ids": ids}, ...], use_tqdm=False)` with every input at
once. Start-up (compilation) is load_s, not timed. The `__main__` guard matters: vLLM
spawns its engine-core process, which re-imports this module.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers.base import peer_main, prompts_for_repeat, timed  # noqa: E402

_LLM: list[Any] = []


def setup(spec: dict[str, Any], result: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
    threads = int(spec.get("threads") or 2)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(float(spec["kv_cache_gib"])))))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    import torch
    from vllm import LLM

    extra = dict(spec.get("extra") or {})
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        runner="pooling",
        dtype=spec.get("dtype", "float32"),
        max_model_len=int(spec["max_model_len"]),
        max_num_seqs=int(spec["max_num_seqs"]),
        max_num_batched_tokens=int(spec["max_num_batched_tokens"]),
        seed=0,
        **extra,
    )
    _LLM.append(llm)
    result["load_s"] = round(time.perf_counter() - t0, 2)
    result["threads"] = threads
    result["settings"] = {
        "dtype": spec.get("dtype", "float32"),
        "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
        "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "torch": torch.__version__,
        "extra": extra,
    }
    warm = spec.get("warmup_prompts") or []
    if warm:
        t0 = time.perf_counter()
        llm.embed([{"prompt_token_ids": p} for p in warm], use_tqdm=False)
        result["warmup_s"] = round(time.perf_counter() - t0, 2)

    def run_repeat(r: int) -> dict[str, Any]:
        prompts = [{"prompt_token_ids": p} for p in prompts_for_repeat(spec, r)]
        holder: dict[str, Any] = {}

        def run() -> int:
            holder["outs"] = llm.embed(prompts, use_tqdm=False)
            return sum(len(p["prompt_token_ids"]) for p in prompts)

        rec = timed(run)
        rec["inputs_s"] = round(len(prompts) / rec["wall_s"], 2) if rec["wall_s"] else None
        if r == 0:
            first = holder["outs"][0].outputs.embedding
            rec["_first_ids"] = [round(float(x), 6) for x in list(first)[:16]]
        return rec

    return run_repeat


def cleanup() -> None:
    for llm in _LLM:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the parent kills the session anyway
            pass


if __name__ == "__main__":
    peer_main("vllm", setup, cleanup)
