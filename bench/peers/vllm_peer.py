"""vLLM's CPU build on a throughput workload. Runs under the vLLM venv's python
(bench/peers/setup_vllm.py makes it), started by bench/throughput.py in its own process.

`vllm.LLM(model, dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
seed=0)` (dtype from the spec: float32 or bfloat16), the KV cache size from `VLLM_CPU_KVCACHE_SPACE` (GiB, set by the parent to the same
size ours gets) and `VLLM_CPU_OMP_THREADS_BIND=0-1` (both cores; vLLM's default keeps one
free). Then `generate` with every request at once: `SamplingParams(temperature=0,
max_tokens=n, ignore_eos=True)` per request. Start-up (including vLLM's compilation, 40-110 s
here) is reported as load_s and not timed.

The `if __name__ == "__main__":` guard matters: vLLM spawns its engine-core process, which
re-imports this module.
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

from bench.peers.base import greedy_params_and_warm_up, peer_main, prompts_for_repeat, timed  # noqa: E402

_LLM: list[Any] = []


def load_vllm(spec: dict[str, Any], result: dict[str, Any], **kw: Any) -> Any:
    """`vllm.LLM` with the spec's settings (plus `kw`, e.g. runner="pooling"); the KV size and
    threads through vLLM's variables; fills load_s, threads, settings."""
    threads = int(spec.get("threads") or 2)
    kv = str(max(1, round(float(spec["kv_cache_gib"]))))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", kv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    import torch
    from vllm import LLM

    extra = dict(spec.get("extra") or {})
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=int(spec["max_model_len"]),
        max_num_seqs=int(spec["max_num_seqs"]),
        max_num_batched_tokens=int(spec["max_num_batched_tokens"]),
        seed=0,
        **kw,
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
        **kw,
    }
    return llm


def setup(spec: dict[str, Any], result: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
    from vllm import SamplingParams

    llm = load_vllm(spec, result)
    params = greedy_params_and_warm_up(llm, SamplingParams, spec, result)

    def run_repeat(r: int) -> dict[str, Any]:
        prompts = [{"prompt_token_ids": p} for p in prompts_for_repeat(spec, r)]
        holder: dict[str, Any] = {}

        def run() -> int:
            outs = llm.generate(prompts, params, use_tqdm=False)
            holder["outs"] = outs
            return sum(len(o.outputs[0].token_ids) for o in outs)

        rec = timed(run)
        if r == 0:
            rec["_first_ids"] = list(holder["outs"][0].outputs[0].token_ids)
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
