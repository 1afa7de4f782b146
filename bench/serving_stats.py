"""What bench/serving.py (HTTP), bench/serving_grpc.py (gRPC) and bench/serving_vs.py (ours
against vLLM's server) share, so they measure alike.

serving.py and serving_grpc.py drive the prompts from `concurrency` workers (`run_workers`);
serving_vs.py sends them at Poisson arrival times (`run_arrivals`). All record one `Sample`
per request (TTFT, inter-chunk latencies, end-to-end time, tokens) and reduce them with
`summarize` to the same JSON keys, so their rows in bench/results/ compare directly. Only the
transport (one request over httpx or over a gRPC stub) lives in each script. Standard
library only."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PROMPTS = [
    "Once upon a time there was a little girl who lived in a village near the forest.",
    "The capital of France is Paris. Paris is a city on the river Seine, and",
    "Computers process numbers and words. A language model predicts the next token",
    "The dragon slept in a cave under the hill. It was green and gold, and it loved",
]

# The keys of a row printed to the terminal after each concurrency level.
BRIEF_KEYS = ("concurrency", "req_per_s", "output_tok_per_s", "ttft_ms", "itl_ms", "failed")


@dataclass
class Sample:
    """One streamed request: times in seconds, `tokens` as the server's usage reports them."""

    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""
    last: float | None = field(default=None, repr=False)  # when the previous chunk came

    def chunk(self, now: float, t0: float) -> None:
        """A chunk with text arrived at `now` (request sent at `t0`): TTFT or one ITL."""
        if self.last is None:
            self.ttft = now - t0
        else:
            self.itls.append(now - self.last)
        self.last = now


def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank, no interpolation) of seconds, in ms."""
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1000, 3)


async def run_workers(
    request: Callable[[str], Awaitable[Sample]], prompts: list[str], n: int, concurrency: int
) -> tuple[list[Sample], float]:
    """`n` requests (prompts in turn) from `concurrency` workers; (samples, wall seconds)."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(prompts[i % len(prompts)])
    samples: list[Sample] = []

    async def worker() -> None:
        while not queue.empty():
            samples.append(await request(queue.get_nowait()))

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return samples, time.perf_counter() - t0


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times, in seconds from the start, of `n` requests arriving as a Poisson process
    of `rate` per second (exponential gaps; the first at 0). `rate` inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


async def run_arrivals(
    request: Callable[[T], Awaitable[Sample]], prompts: list[T], offsets: list[float]
) -> tuple[list[Sample], float]:
    """Send `prompts[i]` at `offsets[i]` seconds after the start, without waiting for earlier
    answers (open loop); (samples in prompt order, seconds from the start to the last answer)."""
    t0 = time.perf_counter()

    async def one(prompt: T, at: float) -> Sample:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        return await request(prompt)

    samples = await asyncio.gather(*(one(p, at) for p, at in zip(prompts, offsets, strict=True)))
    return list(samples), time.perf_counter() - t0


def summarize(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if s.ok]
    tokens = sum(s.tokens for s in ok)
    itls = [x for s in ok for x in s.itls]
    # Time per output token after the first, per request: unlike ITL it does not depend on
    # how many tokens a server packs into one chunk.
    tpots = [(s.e2e - s.ttft) / (s.tokens - 1) for s in ok if s.tokens > 1]
    chunks = sum(len(s.itls) + 1 for s in ok if s.last is not None)
    return {
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if not s.ok})[:3],
        "wall_s": round(wall, 3),
        "req_per_s": round(len(ok) / wall, 3),
        "output_tok_per_s": round(tokens / wall, 2),
        "ttft_ms": {f"p{q}": pct([s.ttft for s in ok], q) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": pct(itls, q) for q in (50, 90, 99)},
        "e2e_ms": {f"p{q}": pct([s.e2e for s in ok], q) for q in (50, 90, 99)},
        "mean_itl_ms": round(statistics.fmean(itls) * 1000, 3) if itls else None,
        "tpot_ms": {f"p{q}": pct(tpots, q) for q in (50, 90, 99)},
        "tokens_per_chunk": round(tokens / chunks, 3) if chunks else None,
    }


def write_rows(out: str | Path, rows: list[dict]) -> None:
    """Append `rows` as JSON lines to `out`."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {out}")
