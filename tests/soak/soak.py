"""Soak: `appliance serve` under mixed HTTP + gRPC load for N minutes; nothing may creep.

    python tests/soak/soak.py --minutes 10 [--model DIR] [--concurrency 8] [--out FILE]

Starts the server as a user would (a subprocess, the tiny test checkpoint unless --model
is given) and keeps `--concurrency` clients busy with a weighted mix: completions and chat,
streamed and not, n > 1, clients that vanish mid-stream, gRPC generations and calls
cancelled at random points, KServe inference, tokenize, and requests that must be refused
(400). Every few seconds it samples the server's RSS and open file descriptors; at the end
it waits for the server to go idle, reads /metrics and sends SIGTERM.

It fails (exit 1) when any request ends in an unexpected way, a KV block is still held
when idle, the running/waiting gauges are not 0, the server does not exit 0 on SIGTERM, or
RSS / fds grow after warm-up beyond `--max-rss-drift-mib` / `--max-fd-drift`. The summary
(requests by outcome, blocks leaked, RSS and fd drift) is printed as JSON and written to
`--out`; docs/reliability.md quotes it. Not collected by pytest (no `test_` prefix): it is
minutes long by design.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import httpx  # noqa: E402

from appliance.grpc.kserve_tensors import encode_bytes  # noqa: E402
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb  # noqa: E402
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc  # noqa: E402
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb  # noqa: E402
from appliance.grpc.proto.inference import grpc_service_pb2_grpc as kpb_grpc  # noqa: E402
from tests.support.served_stack import ServeProcess, gauges, spawn_serve, tiny_serve_sets  # noqa: E402

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "What is the capital of France?",
    "A journey of a thousand miles",
    "The dragon slept in a cave under the hill and",
]


# ---- the load -----------------------------------------------------------------------------
class Load:
    """Weighted actions; each returns the outcome kind it observed."""

    def __init__(self, http: httpx.AsyncClient, channel: grpc.aio.Channel, rng: random.Random):
        self.http = http
        self.stub = pb_grpc.ApplianceStub(channel)
        self.kstub = kpb_grpc.GRPCInferenceServiceStub(channel)
        self.rng = rng
        self.actions: list[tuple[int, Callable[[], Awaitable[str]]]] = [
            (20, self.completion),
            (20, self.chat_stream),
            (8, self.completion_n2),
            (10, self.http_vanish),
            (8, self.bad_request),
            (20, self.grpc_generate),
            (8, self.grpc_cancel),
            (4, self.kserve),
            (2, self.tokenize),
        ]

    def pick(self) -> Callable[[], Awaitable[str]]:
        weights = [w for w, _ in self.actions]
        return self.rng.choices([a for _, a in self.actions], weights)[0]

    def _tokens(self) -> int:
        return self.rng.randint(4, 24)

    @staticmethod
    def _http_outcome(status: int) -> str:
        return {200: "ok", 429: "refused_429"}.get(status, f"error_http_{status}")

    async def completion(self) -> str:
        body = {"prompt": self.rng.choice(PROMPTS), "max_tokens": self._tokens(),
                "temperature": self.rng.choice([0.0, 0.8])}  # fmt: skip
        return self._http_outcome((await self.http.post("/v1/completions", json=body)).status_code)

    async def completion_n2(self) -> str:
        body = {"prompt": [self.rng.choice(PROMPTS)] * 2, "n": 2, "max_tokens": 6, "seed": 1}
        return self._http_outcome((await self.http.post("/v1/completions", json=body)).status_code)

    async def chat_stream(self) -> str:
        body = {"messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}],
                "max_tokens": self._tokens(), "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return self._http_outcome(r.status_code)
            text = (await r.aread()).decode()
        if not text.endswith("data: [DONE]\n\n") or '"error"' in text:
            return "error_sse"
        return "ok"

    async def http_vanish(self) -> str:
        body = {"prompt": self.rng.choice(PROMPTS), "max_tokens": 100, "stream": True,
                "ignore_eos": True}  # fmt: skip
        async with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return self._http_outcome(r.status_code)
            n = self.rng.randint(0, 5)
            async for _ in r.aiter_lines():
                n -= 1
                if n < 0:
                    break
        return "vanished"

    async def bad_request(self) -> str:
        body = self.rng.choice(
            [
                {"prompt": "x", "temperature": -1},
                {"messages": []},
                {"prompt": [10**6]},
                {"prompt": "x", "max_tokens": 10**6},
                {"prompt": "x", "n": 99},
            ]  # fmt: skip
        )
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status = (await self.http.post(path, json=body)).status_code
        return "refused_400" if status == 400 else f"error_http_{status}"

    async def grpc_generate(self) -> str:
        req = pb.GenerateRequest(
            text=self.rng.choice(PROMPTS),
            sampling=pb.SamplingParams(max_tokens=self._tokens(), temperature=0.0),
        )
        try:
            last = None
            async for r in self.stub.Generate(req, timeout=60):
                last = r
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return "refused_resource_exhausted"
            return f"error_grpc_{e.code().name}"
        return "ok" if last is not None and last.HasField("usage") else "error_grpc_no_usage"

    async def grpc_cancel(self) -> str:
        req = pb.GenerateRequest(
            text=self.rng.choice(PROMPTS),
            sampling=pb.SamplingParams(max_tokens=100, ignore_eos=True),
        )
        call = self.stub.Generate(req, timeout=60)
        try:
            for _ in range(self.rng.randint(0, 5)):
                if await call.read() is grpc.aio.EOF:
                    break
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return "refused_resource_exhausted"
            return f"error_grpc_{e.code().name}"
        call.cancel()
        return "cancelled"

    async def kserve(self) -> str:
        req = kpb.ModelInferRequest(model_name="tiny", id="soak")
        for name, dt, raw in (
            ("text_input", "BYTES", encode_bytes([self.rng.choice(PROMPTS).encode()])),
            ("sampling_parameters", "BYTES", encode_bytes([b'{"max_tokens": 8}'])),
        ):
            req.inputs.add(name=name, datatype=dt, shape=[1])
            req.raw_input_contents.append(raw)
        try:
            await self.kstub.ModelInfer(req, timeout=60)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return "refused_resource_exhausted"
            return f"error_grpc_{e.code().name}"
        return "ok"

    async def tokenize(self) -> str:
        r = await self.http.post("/tokenize", json={"prompt": self.rng.choice(PROMPTS)})
        return self._http_outcome(r.status_code)


# ---- sampling the server ------------------------------------------------------------------
def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) pairs, per minute."""
    if len(samples) < 2:
        return 0.0
    xs, ys = [x for x, _ in samples], [y for _, y in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


async def drive(
    server: ServeProcess, minutes: float, concurrency: int, seed: int
) -> dict[str, Any]:
    outcomes: Counter[str] = Counter()
    timeline: list[dict[str, float]] = []
    pid = server.proc.pid
    deadline = time.monotonic() + minutes * 60
    t0 = time.monotonic()

    async def worker(i: int, load: Load) -> None:
        while time.monotonic() < deadline:
            action = load.pick()
            try:
                outcomes[await asyncio.wait_for(action(), 120)] += 1
            except TimeoutError:
                outcomes[f"error_hang_{action.__name__}"] += 1
            except Exception as e:  # a transport failure is an outcome too
                outcomes[f"error_{action.__name__}_{type(e).__name__}"] += 1

    async def sampler() -> None:
        while time.monotonic() < deadline:
            timeline.append({"t": round(time.monotonic() - t0, 1), "rss_mib": rss_mib(pid),
                             "fds": open_fds(pid)})  # fmt: skip
            await asyncio.sleep(5)

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http,
        grpc.aio.insecure_channel(server.grpc_address) as channel,
    ):
        rngs = [random.Random(seed + i) for i in range(concurrency)]
        await asyncio.gather(
            sampler(), *[worker(i, Load(http, channel, rngs[i])) for i in range(concurrency)]
        )
    return {"outcomes": dict(outcomes), "timeline": timeline}


def summarize(run: dict[str, Any], minutes: float, end: dict[str, float]) -> dict[str, Any]:
    timeline = run["timeline"]
    warm_s = max(60.0, minutes * 60 * 0.2)  # allocator and caches settle in the first fifth
    after = [p for p in timeline if p["t"] >= warm_s] or timeline
    head = after[: max(1, len(after) // 10)]
    tail = after[-max(1, len(after) // 10) :]
    outcomes = run["outcomes"]
    return {
        "minutes": minutes,
        "requests_sent": sum(outcomes.values()),
        "outcomes": dict(sorted(outcomes.items())),
        "errors": {k: v for k, v in outcomes.items() if k.startswith("error")},
        "blocks_leaked": int(end["appliance_kv_cache_blocks"] - end["appliance_kv_cache_free_blocks"]),
        "gauges_after": {k.removeprefix("appliance_"): end[k] for k in (
            "appliance_requests_running", "appliance_requests_waiting",
            "appliance_requests_in_flight")},  # fmt: skip
        "warmup_s": warm_s,
        "rss_mib_start": round(timeline[0]["rss_mib"], 1),
        "rss_mib_after_warmup": round(statistics.fmean(p["rss_mib"] for p in head), 1),
        "rss_mib_end": round(statistics.fmean(p["rss_mib"] for p in tail), 1),
        "rss_drift_mib": round(
            statistics.fmean(p["rss_mib"] for p in tail)
            - statistics.fmean(p["rss_mib"] for p in head), 1
        ),
        "rss_slope_mib_per_min": round(slope_per_min([(p["t"], p["rss_mib"]) for p in after]), 3),
        "fds_after_warmup": [min(p["fds"] for p in after), max(p["fds"] for p in after)],
        "fd_drift": tail[-1]["fds"] - head[0]["fds"],
        "preemptions": end.get("appliance_preemptions_total", 0),
        "generation_tokens": end.get("appliance_generation_tokens_total", 0),
        "samples": len(timeline),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint dir (default: tiny)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-rss-drift-mib", type=float, default=25.0)
    ap.add_argument("--max-fd-drift", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tests.support.tiny_models import make_tiny_checkpoint

            model = make_tiny_checkpoint(Path(tmp) / "tiny", "llama")
        sets = tiny_serve_sets(
            model,
            **{
                # 24 blocks of 16 tokens: 8 clients at up to 128 tokens each overflow it,
                # so the soak preempts and recomputes as well.
                "cache.num_kv_blocks": 24,
                "scheduler.max_num_seqs": 16,
                "scheduler.max_queue_len": 64,
                "server.shutdown_grace_s": 10,
            },
        )
        server = spawn_serve(["serve", *sets, *[a for s in args.extra for a in ("--set", s)]])
        try:
            run = asyncio.run(drive(server, args.minutes, args.concurrency, args.seed))
            deadline = time.monotonic() + 30
            while True:  # idle: nothing in flight, then read the final gauges
                end = gauges(server.url)
                if end["appliance_requests_in_flight"] == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            time.sleep(0.5)
            end = gauges(server.url)
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(60)
        finally:
            if server.proc.poll() is None:
                server.proc.kill()
    summary = summarize(run, args.minutes, end)
    summary["exit_code_on_sigterm"] = code
    problems = []
    if summary["errors"]:
        problems.append(f"unexpected outcomes {summary['errors']}")
    if summary["blocks_leaked"]:
        problems.append(f"{summary['blocks_leaked']} KV blocks leaked")
    if any(summary["gauges_after"].values()):
        problems.append(f"gauges not 0: {summary['gauges_after']}")
    if abs(summary["rss_drift_mib"]) > args.max_rss_drift_mib:
        problems.append(f"RSS drifted {summary['rss_drift_mib']} MiB after warm-up")
    if abs(summary["fd_drift"]) > args.max_fd_drift:
        problems.append(f"open fds drifted by {summary['fd_drift']}")
    if code != 0:
        problems.append(f"exit code {code} on SIGTERM")
    summary["problems"] = problems
    text = json.dumps({**summary, "timeline": run["timeline"]}, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(json.dumps(summary, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
