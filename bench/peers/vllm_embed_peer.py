"""vLLM's CPU build on an embedding workload: its pooling runner. Runs under the vLLM
venv's python (bench/peers/setup_vllm.py), started by bench/embeddings.py in its own process.

`vllm.LLM(model, runner="pooling", dtype, max_model_len, max_num_seqs,
max_num_batched_tokens, seed=0)` (vllm_peer.load_vllm: KV size and threads through
`VLLM_CPU_KVCACHE_SPACE` / `VLLM_CPU_OMP_THREADS_BIND`): vLLM reads the checkpoint's
sentence-transformers pooling files as we do (last token, normalized). Then
`embed([{"prompt_token_ids": ids}, ...], use_tqdm=False)` with every input at once
(base.embedding_runner). Start-up (compilation) is load_s, not timed. The `__main__` guard
matters: vLLM spawns its engine-core process, which re-imports this module.
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
from bench.peers.vllm_peer import cleanup, load_vllm  # noqa: E402


def setup(spec: dict[str, Any], result: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
    llm = load_vllm(spec, result, runner="pooling")
    return embedding_runner(lambda prompts: llm.embed(prompts, use_tqdm=False), spec, result)


if __name__ == "__main__":
    peer_main("vllm", setup, cleanup)
