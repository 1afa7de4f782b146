"""The client side of bench/tenants.py: open-loop sends per tenant, and the percentiles.

Each tenant's requests (`Plan`: when, which prompt, which deadline) are sent from a client
process of its own at Poisson times (`send_by_tenant`), so that a flood's client work never
delays the other tenant's sends; every answer is a `Sent` (status, end-to-end seconds,
tokens, the request id the server's spans are matched by). Requests still unanswered
`drain_s` after the last send are cancelled and counted, never waited for.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from bench.common import log

__all__ = ["KEYS", "VOCAB", "Plan", "Sent", "pct", "poisson", "prompts", "r4", "send_by_tenant"]

KEYS = {"A": "key-a", "B": "key-b"}  # API key per tenant (the server's TENANTS_YAML)


@dataclass
class Sent:
    tenant: str
    at: float  # seconds from the run's start
    status: int = 0
    e2e: float = 0.0
    tokens: int = 0
    request_id: str = ""
    deadline_s: float | None = None  # the deadline the client holds it to
    sent_epoch: float = 0.0  # time.time() when it was sent (to compare with span starts)

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class Plan:
    tenant: str
    at: float
    prompt: list[int]
    deadline_s: float | None = None
    send_timeout: bool = False  # send the deadline as X-Request-Timeout


VOCAB = [1000, 40000]  # token ids the prompts draw from (set from the model in main)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Random token ids (no two prompts share a cached block)."""
    rng = random.Random(seed)
    lo, hi = VOCAB
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def poisson(rate: float, duration: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


async def send_all(
    url: str, plans: list[Plan], output_len: int, drain_s: float, start_epoch: float
) -> list[Sent]:
    """Sends every plan at `start_epoch` + its time (open loop); the answers, in plan order.
    Requests still unanswered `drain_s` after the last send are cancelled (status -2)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.sleep(max(0.0, start_epoch - time.time()))
        t0 = time.perf_counter()

        async def one(p: Plan) -> Sent:
            await asyncio.sleep(max(0.0, t0 + p.at - time.perf_counter()))
            sent = Sent(p.tenant, p.at, deadline_s=p.deadline_s)
            headers = {"Authorization": f"Bearer {KEYS[p.tenant]}"}
            if p.send_timeout and p.deadline_s is not None:
                headers["X-Request-Timeout"] = f"{p.deadline_s:.3f}"
            body = {"prompt": p.prompt, "max_tokens": output_len, "ignore_eos": True}
            start = time.perf_counter()
            sent.sent_epoch = time.time()
            try:
                r = await client.post(f"{url}/v1/completions", json=body, headers=headers)
                sent.status = r.status_code
                sent.request_id = r.headers.get("x-request-id", "")
                if r.status_code == 200:
                    data = r.json()
                    sent.request_id = data["id"]
                    sent.tokens = data["usage"]["completion_tokens"]
            except httpx.HTTPError as e:
                sent.status = -1
                log(f"request failed: {type(e).__name__}: {e}")
            sent.e2e = time.perf_counter() - start
            return sent

        tasks = [asyncio.create_task(one(p)) for p in plans]
        last = max((p.at for p in plans), default=0.0)
        await asyncio.wait(tasks, timeout=max(0.0, t0 + last + drain_s - time.perf_counter()))
        out = []
        for task, p in zip(tasks, plans, strict=True):
            if task.done():
                out.append(task.result())
            else:
                task.cancel()
                out.append(Sent(p.tenant, p.at, status=-2, deadline_s=p.deadline_s))
        await asyncio.gather(*tasks, return_exceptions=True)
        return out


def _client(url: str, plans: list[Plan], output_len: int, drain_s: float, start: float):
    return asyncio.run(send_all(url, plans, output_len, drain_s, start))


def send_by_tenant(url: str, plans: list[Plan], output_len: int, drain_s: float) -> list[Sent]:
    """Each tenant's plans from a client process of its own, all starting together, so
    that the flood's client work never delays the other tenant's sends."""
    from concurrent.futures import ProcessPoolExecutor

    tenants = sorted({p.tenant for p in plans})
    start = time.time() + 1.0
    with ProcessPoolExecutor(len(tenants)) as pool:
        futures = [
            pool.submit(
                _client, url, [p for p in plans if p.tenant == t], output_len, drain_s, start
            )
            for t in tenants
        ]
        sent = [s for f in futures for s in f.result()]
    return sorted(sent, key=lambda s: s.at)


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
