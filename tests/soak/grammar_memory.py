"""Soak: distinct large grammars through the engine; RSS must level off (issue 28, B5).

    python tests/soak/grammar_memory.py [--requests 60] [--repeat 40000] [--out FILE]

Each request constrains its output with a distinct `regex: "a{K+i}"` (80 bytes of request,
megabytes of llguidance lexer states) and asks for one token, as the issue's reproduction
did. Two engines run one after the other, each in its own process so their RSS is their
own: one with `structured_outputs.cache_mib` at its default (256), one with the cache
bounded by entries only (`cache_mib` 100000: what the code did before the byte bound). RSS
is sampled after every request. The bounded run must level off: over the second half of
its requests RSS may grow by at most `--max-drift-mib` (default 64), while the unbounded
one keeps growing by about a grammar's size per request. The summary is printed as JSON
(and appended to `--out`). Not collected by pytest (no `test_` prefix): it takes minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_one(cache_mib: int, requests: int, repeat: int, model_dir: str) -> dict:
    """In this process: one engine, `requests` distinct grammars, RSS after each."""
    from engine import SamplingParams, StructuredOutputsParams
    from engine.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        RuntimeConfig,
        StructuredOutputsConfig,
    )  # fmt: skip
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(path=model_dir, max_model_len=64, dtype="float32"),
            cache=CacheConfig(num_kv_blocks=64, block_size=16),
            runtime=RuntimeConfig(device="cpu", num_threads=1),
            structured_outputs=StructuredOutputsConfig(cache_mib=cache_mib, max_grammar_mib=64),
        )
    )
    rss, refused = [], 0
    t0 = time.perf_counter()
    for i in range(requests):
        spec = StructuredOutputsParams(regex=f"a{{{repeat + i}}}")
        params = SamplingParams(max_tokens=1, structured_outputs=spec)
        try:
            engine.add_request(str(i), "Hello", params)
        except ValueError:  # refused (above max_grammar_mib): nothing was kept
            refused += 1
        while engine.has_unfinished_requests():
            engine.step()
        rss.append(round(_rss_mib(), 1))
    half = rss[len(rss) // 2 :]
    return {
        "cache_mib": cache_mib,
        "requests": requests,
        "refused": refused,
        "rss_mib": rss,
        "rss_first_mib": rss[0],
        "rss_final_mib": rss[-1],
        "second_half_growth_mib": round(max(half) - half[0], 1),
        "cached_mib": round(engine.grammars.cached_bytes() / 2**20, 1),
        "cached_grammars": len(engine.grammars._cache),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=40000, help="K in a{K+i}")
    ap.add_argument("--max-drift-mib", type=float, default=64.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(run_one(args.child, args.requests, args.repeat, args.model)))
        return 0
    from bench.common import machine_info
    from tests.support.tiny_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_checkpoint(Path(tmp) / "tiny", "llama"))
        runs = {}
        for name, cache_mib in (("bounded", 256), ("entries_only", 100000)):
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(cache_mib), "--model", model,
                 "--requests", str(args.requests), "--repeat", str(args.repeat)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "grammar": f"regex a{{{args.repeat}+i}}, max_tokens 1",
        **runs,
    }
    text = json.dumps(summary)
    print(text)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(text + "\n")
    ok = runs["bounded"]["second_half_growth_mib"] <= args.max_drift_mib
    print(
        f"bounded: RSS {runs['bounded']['rss_first_mib']} -> {runs['bounded']['rss_final_mib']} MiB "
        f"(second half +{runs['bounded']['second_half_growth_mib']}); entries only: "
        f"{runs['entries_only']['rss_first_mib']} -> {runs['entries_only']['rss_final_mib']} MiB",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
