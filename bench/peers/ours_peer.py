"""Our engine on a throughput workload (run by bench/throughput.py in its own process).

`LLM(path, dtype, kv_cache_gib, max_num_seqs, max_num_batched_tokens, max_model_len,
num_threads)` (dtype from the spec: float32 or bfloat16, whatever the checkpoint holds),
then `generate([{"prompt_token_ids": ids}, ...], [SamplingParams(temperature=0,
max_tokens=n, ignore_eos=True), ...], use_tqdm=False)` with every request submitted at once.

Besides tokens/s, each run records a prefill/decode split measured by wrapping the engine's
`step` (timing) and `scheduler.schedule` (what the step held): a step is "decode" when every
scheduled request computes exactly one token, "prefill" otherwise (mixed steps count as
prefill). The wrappers cost a perf_counter call per step. If the engine's internals move,
the split is dropped, never the run.
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

from bench.peers.base import greedy_params_and_warm_up, peer_main, prompts_for_repeat, timed  # noqa: E402


class StepSplit:
    """Per-step timing of LLMEngine.step, classified by the SchedulerOutput it ran."""

    def __init__(self, engine: Any):
        self.ok = False
        self.reset()
        try:
            sched = engine.scheduler
            orig_schedule, orig_step = sched.schedule, engine.step
        except AttributeError:
            return

        def schedule(*a: Any, **kw: Any) -> Any:
            so = orig_schedule(*a, **kw)
            self._last = so
            return so

        def step(*a: Any, **kw: Any) -> Any:
            self._last = None
            t0 = time.perf_counter()
            out = orig_step(*a, **kw)
            dt = time.perf_counter() - t0
            self._record(dt)
            return out

        sched.schedule = schedule
        engine.step = step
        self.ok = True

    def reset(self) -> None:
        self.prefill_s = self.decode_s = 0.0
        self.prefill_steps = self.decode_steps = 0
        self.prefill_tokens = self.decode_tokens = 0
        self.mixed_decode_tokens = 0
        self._last = None

    def _record(self, dt: float) -> None:
        so = self._last
        if so is None:
            return
        try:
            counts = so.num_scheduled_tokens
            total = int(so.total_num_scheduled_tokens)
        except AttributeError:
            return
        n = len(counts)
        if n == 0:
            return
        if total == n:
            self.decode_steps += 1
            self.decode_s += dt
            self.decode_tokens += n
        else:
            self.prefill_steps += 1
            self.prefill_s += dt
            self.prefill_tokens += total

    def as_dict(self) -> dict[str, Any]:
        d = {
            "prefill_steps": self.prefill_steps,
            "prefill_s": round(self.prefill_s, 4),
            "prefill_tokens": self.prefill_tokens,
            "prefill_tok_s": round(self.prefill_tokens / self.prefill_s, 1) if self.prefill_s else None,
            "decode_steps": self.decode_steps,
            "decode_s": round(self.decode_s, 4),
            "decode_tokens": self.decode_tokens,
            "decode_tok_s": round(self.decode_tokens / self.decode_s, 1) if self.decode_s else None,
            "mean_decode_batch": round(self.decode_tokens / self.decode_steps, 1) if self.decode_steps else None,
        }  # fmt: skip
        return d


def load_llm(spec: dict[str, Any], result: dict[str, Any], **kw: Any) -> Any:
    """`engine.LLM` with the spec's settings (plus `kw`); fills load_s, threads, settings."""
    import torch

    from engine import LLM

    threads = int(spec.get("threads") or 2)
    torch.set_num_threads(threads)
    extra = dict(spec.get("extra") or {})
    t0 = time.perf_counter()
    llm = LLM(
        spec["model"],
        dtype=spec.get("dtype", "float32"),
        kv_cache_gib=float(spec["kv_cache_gib"]),
        max_num_seqs=int(spec["max_num_seqs"]),
        max_num_batched_tokens=int(spec["max_num_batched_tokens"]),
        max_model_len=int(spec["max_model_len"]),
        num_threads=threads,
        **kw,
        **extra,
    )
    result["load_s"] = round(time.perf_counter() - t0, 2)
    result["threads"] = torch.get_num_threads()
    result["settings"] = {"dtype": spec.get("dtype", "float32"), "extra": extra, **kw}
    return llm


def setup(spec: dict[str, Any], result: dict[str, Any]) -> Callable[[int], dict[str, Any]]:

    from engine import SamplingParams

    llm = load_llm(spec, result)
    params = greedy_params_and_warm_up(llm, SamplingParams, spec, result)

    split = StepSplit(llm.engine)

    def run_repeat(r: int) -> dict[str, Any]:
        prompts = [{"prompt_token_ids": p} for p in prompts_for_repeat(spec, r)]
        split.reset()
        holder: dict[str, Any] = {}

        def run() -> int:
            outs = llm.generate(prompts, params, use_tqdm=False)
            holder["outs"] = outs
            return sum(len(o.outputs[0].token_ids) for o in outs)

        rec = timed(run)
        if split.ok:
            rec["split"] = split.as_dict()
        if r == 0:
            rec["_first_ids"] = list(holder["outs"][0].outputs[0].token_ids)
        try:
            rec["preemptions_total"] = llm.engine.stats().num_preemptions
        except AttributeError:
            pass
        return rec

    return run_repeat


if __name__ == "__main__":
    peer_main("ours", setup)
