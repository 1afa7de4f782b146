"""Our engine on an embedding workload (run by bench/embeddings.py in its own process).

`LLM(path, task="embed", dtype, kv_cache_gib, max_num_seqs, max_num_batched_tokens,
max_model_len, num_threads)` (ours_peer.load_llm), then `embed([{"prompt_token_ids": ids},
...], use_tqdm=False)` with every input submitted at once (base.embedding_runner).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers.base import embedding_runner, peer_main  # noqa: E402
from bench.peers.ours_peer import load_llm  # noqa: E402


def setup(spec: dict[str, Any], result: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
    llm = load_llm(spec, result, task="embed")
    result["settings"]["pooling"] = str(llm.engine.pooling)
    return embedding_runner(lambda prompts: llm.embed(prompts, use_tqdm=False), spec, result)


if __name__ == "__main__":
    peer_main("ours", setup)
