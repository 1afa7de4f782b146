"""What a CPU host tier could be, measured: the numbers behind `cache.host_tier_gib` on the
CPU growing the pool instead of being a tier (engine/worker/kv_tier/setup.py).

On the CPU the KV pool is host memory. For one KV block of the model (all layers) this
measures, in one process, 2 threads:

- `prefill_ms_per_block`: what a miss costs, prefilling a 1,024-token prompt, per block;
- `copy_ms`: a host tier load (the block copied from a host buffer into the pool) and a
  save (the reverse): what a tier in the same memory adds to every hit, where a pool hit
  of the same bytes costs nothing;
- `zlib1_ratio` / `zlib1_mb_s` and `zlib1_decode_mb_s`: lossless compression of real KV
  (the blocks the prefill wrote), level 1, the fastest: how much more a compressed host
  tier would hold, and at what cost per load.

    python bench/kv_tier_host_choice.py [--model smollm2]

Results: bench/results/kv_tier_host_choice.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, LoadMeter, base_record, log, versions, write_jsonl  # noqa: E402
from bench.workloads import ensure_model, model_info  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import torch

    from engine import LLM, SamplingParams

    model = ensure_model(args.model)
    llm = LLM(str(model), dtype="float32", num_threads=2, max_model_len=args.tokens + 8,
              num_kv_blocks=args.tokens // 16 + 4, enable_prefix_caching=False)  # fmt: skip
    prompt = [(i * 7919) % 30000 + 100 for i in range(args.tokens)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with LoadMeter() as meter:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        prefill_ms_block = statistics.median(times) * 1000 / (args.tokens // 16)
        caches = llm.engine.runner.kv_caches
        host = torch.empty((len(caches), *caches[0].shape[1:]), dtype=caches[0].dtype)
        nbytes = host.numel() * host.element_size()
        loads, saves = [], []
        for b in range(args.tokens // 16):
            t0 = time.perf_counter()
            for layer, c in enumerate(caches):
                host[layer].copy_(c[b])
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for layer, c in enumerate(caches):
                c[b].copy_(host[layer])
            loads.append(time.perf_counter() - t0)
        blocks = [torch.stack([c[b] for c in caches]).numpy().tobytes() for b in range(8)]
        t0 = time.perf_counter()
        packed = [zlib.compress(x, 1) for x in blocks]
        enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        for x in packed:
            zlib.decompress(x)
        dec = time.perf_counter() - t0
    raw = sum(len(x) for x in blocks)
    rec = base_record("kv_tier_host_choice")
    rec.update(
        model=args.model, model_info=model_info(model), versions=versions(), block_bytes=nbytes,
        prefill_ms_per_block=round(prefill_ms_block, 3),
        copy_ms={"load": round(statistics.median(loads) * 1000, 4),
                 "save": round(statistics.median(saves) * 1000, 4)},
        zlib1_ratio=round(sum(len(x) for x in packed) / raw, 3),
        zlib1_mb_s=round(raw / enc / 1e6, 1), zlib1_decode_mb_s=round(raw / dec / 1e6, 1),
        load=meter.as_dict(),
    )  # fmt: skip
    write_jsonl(RESULTS_DIR / "kv_tier_host_choice.jsonl", rec)
    log(str({k: rec[k] for k in ("block_bytes", "prefill_ms_per_block", "copy_ms", "zlib1_ratio",
                                  "zlib1_mb_s", "zlib1_decode_mb_s", "load")}))  # fmt: skip


if __name__ == "__main__":
    main()
