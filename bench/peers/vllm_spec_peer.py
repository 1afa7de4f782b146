"""vLLM's CPU build on bench/spec_copy.py's copy task: one greedy stream, with or without its
speculation. Runs under the vLLM venv's python (bench/peers/setup_vllm.py), one process per
`speculative_config`, started and commanded by spec_copy.py (the bench/peers/base.py protocol).

`vllm.LLM(model, dtype, max_model_len, max_num_seqs, max_num_batched_tokens, seed=0,
disable_log_stats=False, speculative_config=spec["extra"]["speculative_config"])` (through
vllm_peer.load_vllm: KV size and threads from `VLLM_CPU_KVCACHE_SPACE` /
`VLLM_CPU_OMP_THREADS_BIND`). Each repeat generates the spec's one prompt with
`SamplingParams(temperature=0, max_tokens=n)` (no ignore_eos: ours stops at EOS too) and
reports, in its run record:

- `tpot_ms` / `ttft_s` from the request's own timestamps (spec_timing.request_timing), or,
  where vLLM leaves them out, from stepping `llm.llm_engine` and noting when the token count
  grows (spec_timing.tpot_from_observations); `tpot_source` says which;
- `ids` (the output token ids, compared with ours by the parent), `tokens`, `tok_s`;
- `spec`: vLLM's own counters (`LLM.get_metrics()`, the `vllm:spec_decode_*` names) over
  this repeat.

Every repeat sends the same prompt, as spec_copy.py does for ours: TPOT is decode time, which
a prefix-cache hit on the prompt does not change. The `__main__` guard matters: vLLM spawns
its engine-core process, which re-imports this module.
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

from bench.peers.base import peer_main, timed  # noqa: E402
from bench.peers.spec_timing import (  # noqa: E402
    request_timing,
    spec_counters,
    tpot_from_observations,
)
from bench.peers.vllm_peer import cleanup, load_vllm  # noqa: E402


def _counters(llm: Any) -> dict[str, Any] | None:
    """vLLM's speculation counters now, or None where `get_metrics` is missing or fails."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - counters are a report, not a precondition
        return None
    pairs = [(m.name, getattr(m, "values", None) or getattr(m, "value", 0)) for m in metrics]
    return spec_counters(pairs)


def _step_loop(llm: Any, prompt_ids: list[int], params: Any) -> tuple[list[int], dict]:
    """Generate by stepping the engine; (ids, timing) from when the token count grew."""
    from vllm.sampling_params import RequestOutputKind

    p = params.clone()
    p.output_kind = RequestOutputKind.CUMULATIVE
    engine = llm.llm_engine
    rid = f"spec-copy-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt_ids}, p)
    obs: list[tuple[float, int]] = []
    ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                ids = list(out.outputs[0].token_ids)
                obs.append((time.perf_counter(), len(ids)))
    return ids, tpot_from_observations(obs, t0)


def setup(spec: dict[str, Any], result: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
    from vllm import SamplingParams

    extra = dict(spec.get("extra") or {})
    spec = {**spec, "extra": {"speculative_config": extra.get("speculative_config")}}
    if spec["extra"]["speculative_config"] is None:
        spec["extra"] = {}
    llm = load_vllm(spec, result, disable_log_stats=False)
    prompt_ids = list(spec["prompts"][0])
    params = SamplingParams(temperature=0, max_tokens=int(spec["max_tokens"][0]))
    t0 = time.perf_counter()
    (warm,) = llm.generate([{"prompt_token_ids": prompt_ids[:64]}],
                           SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # fmt: skip
    result["warmup_s"] = round(time.perf_counter() - t0, 2)
    # no timestamps on the warm-up's output: time every repeat by stepping the engine
    use_steps = bool(extra.get("step_loop")) or request_timing(warm.metrics, 8) is None
    result["tpot_source"] = "step_loop" if use_steps else "request timestamps"

    def run_repeat(r: int) -> dict[str, Any]:
        holder: dict[str, Any] = {}
        before = _counters(llm)

        def run() -> int:
            if use_steps:
                holder["ids"], holder["timing"] = _step_loop(llm, prompt_ids, params)
            else:
                out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
                holder["ids"] = list(out.outputs[0].token_ids)
                holder["timing"] = request_timing(out.metrics, len(holder["ids"]))
            return len(holder["ids"])

        rec = timed(run)
        timing = holder["timing"] or {"tpot_s": None, "ttft_s": None, "source": None}
        after = _counters(llm)
        tpot = timing["tpot_s"]
        rec.update(
            ids=holder["ids"], tokens=len(holder["ids"]),
            tpot_ms=None if tpot is None else tpot * 1e3, ttft_s=timing["ttft_s"],
            tpot_source=timing["source"],
            spec_before=before, spec_after=after,
        )  # fmt: skip
        return rec

    return run_repeat


if __name__ == "__main__":
    peer_main("vllm", setup, cleanup)
