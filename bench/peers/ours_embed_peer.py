"""Our engine on an embedding workload (run by bench/embeddings.py in its own process).

`LLM(path, task="embed", dtype, kv_cache_gib, max_num_seqs, max_num_batched_tokens,
max_model_len, num_threads)`, then `embed([{"prompt_token_ids": ids}, ...], use_tqdm=False)`
with every input submitted at once. A run's "tokens" are the prompt tokens embedded; the
first input's first 16 floats go back for the cross-check against the peer.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers.base import peer_main, prompts_for_repeat, timed  # noqa: E402


def setup(spec: dict[str, Any], result: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
    import torch

    from engine import LLM

    threads = int(spec.get("threads") or 2)
    t0 = time.perf_counter()
    llm = LLM(
        spec["model"],
        task="embed",
        dtype=spec.get("dtype", "float32"),
        kv_cache_gib=float(spec["kv_cache_gib"]),
        max_num_seqs=int(spec["max_num_seqs"]),
        max_num_batched_tokens=int(spec["max_num_batched_tokens"]),
        max_model_len=int(spec["max_model_len"]),
        num_threads=threads,
        **dict(spec.get("extra") or {}),
    )
    result["load_s"] = round(time.perf_counter() - t0, 2)
    result["threads"] = threads
    result["settings"] = {"torch_threads": torch.get_num_threads(),
                          "pooling": str(llm.engine.pooling)}  # fmt: skip
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
            rec["_first_ids"] = [round(x, 6) for x in holder["outs"][0].outputs.embedding[:16]]
        return rec

    return run_repeat


if __name__ == "__main__":
    peer_main("ours", setup)
