"""gRPC side of the serving benchmark: the same workload as bench/serving.py, over gRPC.

`run_level_grpc(address, concurrency, n, max_tokens, prompts)` streams `appliance.v1`
Generate calls from `concurrency` workers on one channel and returns the same `Sample`s as
serving.py (bench/serving_stats.py), so one `summarize` reports HTTP and gRPC side by side.
Standalone:

    python bench/serving_grpc.py --address 127.0.0.1:50051          # a running server
    python bench/serving_grpc.py --tiny                              # serves a tiny model itself

`--tiny` starts a child process serving only gRPC (AsyncEngine + start_grpc_server) on a
random tiny checkpoint, so the load generator does not share the server's GIL. Results are
JSON lines appended to bench/results/serving_grpc.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb  # noqa: E402
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc  # noqa: E402
from bench.serving_stats import (  # noqa: E402
    BRIEF_KEYS,
    PROMPTS,
    Sample,
    run_workers,
    summarize,
    write_rows,
)

RESULTS = ROOT / "bench" / "results" / "serving_grpc.jsonl"


async def grpc_request(
    stub: pb_grpc.ApplianceStub, prompt: str, max_tokens: int, metadata: tuple = ()
) -> Sample:
    req = pb.GenerateRequest(
        text=prompt,
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )
    s = Sample(ok=False)
    t0 = time.perf_counter()
    try:
        async for r in stub.Generate(req, metadata=metadata):
            now = time.perf_counter()
            if r.HasField("usage"):
                s.tokens = r.usage.completion_tokens
            if not r.text:
                continue
            s.chunk(now, t0)
        s.e2e = time.perf_counter() - t0
        s.ok = True
    except grpc.aio.AioRpcError as e:
        s.error = f"{e.code().name}: {e.details()}"
    return s


async def run_level_grpc(
    address: str,
    concurrency: int,
    n: int,
    max_tokens: int,
    prompts: list[str] = PROMPTS,
    api_key: str | None = None,
) -> tuple[list[Sample], float]:
    """`n` requests from `concurrency` workers; (samples, wall seconds of the timed part)."""
    md = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ApplianceStub(channel)
        await grpc_request(stub, prompts[0], 2, md)  # warm the channel and the engine
        return await run_workers(
            lambda prompt: grpc_request(stub, prompt, max_tokens, md), prompts, n, concurrency
        )


def _serve(model_dir: str, port_file: str) -> None:
    """Child process: the tiny model behind gRPC only, until killed."""
    from appliance.grpc.server import GrpcSettings, start_grpc_server
    from engine.async_engine import AsyncEngine
    from engine.llm import build_engine_config

    cfg = build_engine_config(model_dir, dtype="float32", num_kv_blocks=2048, block_size=16)

    async def main() -> None:
        aeng = AsyncEngine.from_config(cfg)
        server = await start_grpc_server(aeng, GrpcSettings(port=0))
        Path(port_file).write_text(str(server.bound_port))
        await server.wait_for_termination()

    asyncio.run(main())


def _start_tiny() -> tuple[subprocess.Popen, str]:
    from tests.support.tiny_models import make_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp())
    tiny = make_tiny_checkpoint(tmp / "tiny", "llama")
    port_file = tmp / "port"
    cmd = [sys.executable, __file__, "--_serve", str(tiny), str(port_file)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    deadline = time.monotonic() + 300
    while not port_file.exists() or not port_file.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("grpc server did not start")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port_file.read_text()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", help="host:port of a running appliance gRPC server")
    ap.add_argument("--tiny", action="store_true", help="serve a tiny random model (smoke run)")
    ap.add_argument("--api-key")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("-n", "--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--_serve", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._serve:
        _serve(*args._serve)
        return
    if not args.address and not args.tiny:
        ap.error("give --address or --tiny")
    proc, address = _start_tiny() if args.tiny else (None, args.address)
    meta = {
        "bench": "serving", "mode": "grpc", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": platform.node(), "cpus": os.cpu_count(), "tiny": args.tiny,
        "num_requests": args.num_requests, "max_tokens": args.max_tokens,
    }  # fmt: skip
    rows = []
    try:
        for c in [int(x) for x in args.concurrency.split(",")]:
            samples, wall = asyncio.run(
                run_level_grpc(address, c, args.num_requests, args.max_tokens, api_key=args.api_key)
            )
            row = {**meta, "concurrency": c, **summarize(samples, wall)}
            rows.append(row)
            print(json.dumps({k: row[k] for k in BRIEF_KEYS}))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(30)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
