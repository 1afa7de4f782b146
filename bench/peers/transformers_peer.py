"""transformers `generate` with static batches (run by bench/throughput.py in its own process).

What a user without a serving engine would write: the requests in input order, cut into
static batches of `batch_size` (16), each left-padded to its longest prompt, greedy, the
spec's dtype (float32 or bfloat16: the weights are cast on load),
`min_new_tokens = max_new_tokens` = the batch's largest max_tokens (so EOS never ends a
sequence early), default attention implementation (SDPA), `torch.set_num_threads(threads)`.

Throughput counts each request's *requested* tokens only: when a batch mixes output lengths
(w256-long), the extra tokens a static batch generates for its shorter members are work a
static batcher wastes, and they are not credited. `computed_tokens` in the record shows
what was actually generated.
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
    from transformers import AutoModelForCausalLM

    threads = int(spec.get("threads") or 2)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    dtype = spec.get("dtype", "float32")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, dtype)).eval()
    result["load_s"] = round(time.perf_counter() - t0, 2)
    result["threads"] = torch.get_num_threads()
    attn = getattr(model.config, "_attn_implementation", None)
    bs = int(spec.get("batch_size") or 16)
    result["settings"] = {"batch_size": bs, "attn_implementation": attn, "dtype": dtype}
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

    @torch.inference_mode()
    def gen_batch(prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), int(pad), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=int(pad),
        )  # fmt: skip
        return out[:, width:]

    warm = spec.get("warmup_prompts") or []
    if warm:
        t0 = time.perf_counter()
        gen_batch(warm, 8)
        result["warmup_s"] = round(time.perf_counter() - t0, 2)

    max_tokens = [int(m) for m in spec["max_tokens"]]

    def run_repeat(r: int) -> dict[str, Any]:
        prompts = prompts_for_repeat(spec, r)
        holder: dict[str, Any] = {"computed": 0}

        def run() -> int:
            for s in range(0, len(prompts), bs):
                chunk = prompts[s : s + bs]
                n = max(max_tokens[s : s + bs])
                out = gen_batch(chunk, n)
                holder["computed"] += out.numel()
                if s == 0:
                    holder["first"] = out[0].tolist()[: max_tokens[0]]
            return sum(max_tokens)

        rec = timed(run)
        rec["computed_tokens"] = holder["computed"]
        if r == 0:
            rec["_first_ids"] = holder["first"]
        return rec

    return run_repeat


if __name__ == "__main__":
    peer_main("transformers", setup)
