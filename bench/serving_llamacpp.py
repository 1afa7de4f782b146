"""Ours vs llama.cpp's `llama-server` on the same GGUF file and threads (issue 26's table).

Both servers load the default model's file as shipped (SmolLM2-135M-Instruct, Q4_1 with the
tied embedding in Q8_0; ours with `model.quantization: auto`, so the blocks are kept) and
get the same streamed `/v1/completions` client (bench/serving.py's `one_request`: greedy,
128 tokens, ignore_eos):

    one stream    `--single` requests one after another: ITL p50 (and TPOT)
    64 streams    64 requests at once: output tok/s

Then, in a fresh process per format, the weights' RSS of our model (RSS after `load_model`
minus RSS after importing torch; no KV cache), and the RSS of a second load in the same
process (every module the load imports already in: the weights alone), for the GGUF kept
quantized and for `quantization: none` (float32).

llama.cpp is built from source by bench/peers/setup_llamacpp.py (its build flags are in
the record) and started as `llama-server -m FILE -t T -np 64 -c 20480`. The box is shared:
`other_cores` in every row says how much the other processes took.

All the named servers are started first and stay up; the one-stream requests go to them
in turn (A B C A B C ...), so a drift in the shared box's load falls on every engine alike;
the 64-stream runs follow one server at a time (the others idle: neither llama-server nor
our engine thread spins without work). Engines: `ours` (the GGUF kept quantized, the
default config: bf16 activations where the CPU computes bf16 natively), `ours-q-fp32act`
(the same blocks, float32 activations), `ours-i8act` (float32 activations rounded to
int8 for the block kernels, `model.quant_activations: int8`: llama.cpp's numerics),
`ours-i8act-bf16` (the same with the default dtype), `ours-fp32` / `ours-bf16` (`quantization: none`,
the GGUF dequantized by `gguf.quants` to float32 / bfloat16: the old path), `llama.cpp`.

    python bench/serving_llamacpp.py                      # ours vs llama.cpp, 2 threads
    python bench/serving_llamacpp.py --engines ours,ours-fp32,ours-bf16  # no peer
    python bench/serving_llamacpp.py --quick              # 3 single requests, 16 streams
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.common import RESULTS_DIR, LoadMeter, base_record, log, median, write_jsonl  # noqa: E402
from bench.peers import setup_llamacpp  # noqa: E402
from bench.servers import ROOT, Server, free_port  # noqa: E402
from bench.serving import one_request  # noqa: E402
from bench.serving_stats import run_workers, summarize  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint. Once upon a time,"
LLAMA_FLAGS = ["-np", "64", "-c", "20480"]


def default_gguf() -> str:
    from engine.worker.models.default_model import default_model_gguf

    return str(default_model_gguf())


# Our engines: name -> (model.quantization, model.dtype, model.quant_activations).
OURS = {"ours": ("auto", "auto", "auto"), "ours-q-fp32act": ("auto", "float32", "auto"),
        "ours-i8act": ("auto", "float32", "int8"), "ours-i8act-bf16": ("auto", "auto", "int8"),
        "ours-fp32": ("none", "float32", "auto"),
        "ours-bf16": ("none", "bfloat16", "auto")}  # fmt: skip


def ours(name: str, gguf: str, threads: int, port: int) -> Server:
    quantization, dtype, acts = OURS[name]
    sets = {
        "model.path": gguf, "model.served_name": "bench", "model.quantization": quantization,
        "model.dtype": dtype, "model.quant_activations": acts, "runtime.device": "cpu", "runtime.num_threads": threads,
        "scheduler.max_num_seqs": 64, "server.host": "127.0.0.1", "server.http_port": port,
        "server.grpc_port": "null",
    }  # fmt: skip
    cmd = [sys.executable, "-m", "appliance", "serve"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    return Server(name, cmd, env, port)


def llamacpp(gguf: str, threads: int, port: int) -> Server:
    binary = setup_llamacpp.server_binary()
    cmd = [str(binary), "-m", gguf, "-t", str(threads), *LLAMA_FLAGS,
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    return Server("llama.cpp", cmd, {"OMP_NUM_THREADS": str(threads)}, port)


async def warm_up(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one_request(client, PROMPT, 4, "bench")


async def single_round(url: str, max_tokens: int):
    """One one-stream request (a round of the interleaved one-stream phase)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await run_workers(
            lambda p: one_request(client, p, max_tokens, "bench"), [PROMPT], 1, 1
        )


async def concurrent(url: str, n: int, max_tokens: int):
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1200, limits=limits) as client:
        prompts = [f"{PROMPT} (story {i})" for i in range(n)]
        return await run_workers(
            lambda p: one_request(client, p, max_tokens, "bench"), prompts, n, n
        )


def _row(head: dict, server: Server, mode: str, streams: int, samples, wall, meter) -> dict:
    row = {**head, "engine": server.name, "mode": mode, "streams": streams, "ok": True,
           "startup_s": server.startup_s, **summarize(samples, wall), **meter}  # fmt: skip
    log(f"{server.name} {mode}: ITL p50 {row['itl_ms']['p50']} ms, "
        f"{row['output_tok_per_s']} tok/s, failed {row['failed']}, "
        f"other cores {row['other_cores']}")  # fmt: skip
    return row


def run_servers(servers: list[tuple[Server, dict]], args) -> list[dict]:
    """Start-up, the interleaved one-stream rounds, then 64 streams per server; a server
    that fails is recorded with its error and left out of the rest."""
    rows, up = [], []
    for server, head in servers:
        try:
            server.wait_healthy(args.startup_timeout)
            asyncio.run(warm_up(server.url))
            log(f"{server.name}: healthy after {server.startup_s} s")
            up.append((server, head))
        except Exception as exc:  # noqa: BLE001 - recorded, never skipped silently
            log(f"{server.name}: FAILED: {exc}")
            rows.append({**head, "engine": server.name, "ok": False, "error": str(exc)[:3000]})
    try:
        single: dict[str, list] = {s.name: [[], 0.0, []] for s, _ in up}
        for _ in range(args.single):
            for server, _ in up:
                with LoadMeter() as meter:
                    samples, wall = asyncio.run(single_round(server.url, args.max_tokens))
                acc = single[server.name]
                acc[0] += samples
                acc[1] += wall
                acc[2].append(meter.as_dict())
        for server, head in up:
            samples, wall, meters = single[server.name]
            load = {k: round(median(m[k] for m in meters), 2) for k in meters[0]}
            rows.append(_row(head, server, "single", 1, samples, wall, load))
        for server, head in up:
            if not args.streams:
                break
            with LoadMeter() as meter:
                samples, wall = asyncio.run(concurrent(server.url, args.streams, args.max_tokens))
            rows.append(_row(head, server, "concurrent", args.streams, samples, wall,
                             meter.as_dict()))  # fmt: skip
    finally:
        for server, _ in servers:
            server.stop()
    return rows


_RSS = """
import json, sys, torch
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
torch.set_num_threads(1)
from engine.config import ModelConfig
from engine.worker.models.loader import load_model
config = ModelConfig(path=sys.argv[1], quantization=sys.argv[2])
before = rss()
first = load_model(config, torch.device('cpu'), progress=False)
after_first = rss()
second = load_model(config, torch.device('cpu'), progress=False)  # the first stays alive
after_second = rss()
tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
           for t in [*second.model.parameters(), *second.model.buffers()]}
print(json.dumps({
    'weights_rss_mib': round((after_first - before) / 2**20, 1),
    'second_load_rss_mib': round((after_second - after_first) / 2**20, 1),
    'tensor_mib': round(sum(tensors.values()) / 2**20, 1),
}))
"""


def weights_rss(gguf: str, quantization: str) -> dict | None:
    """RSS of loading the model in a fresh process: the first load (what the goal's
    definition counts, the modules the load imports included: transformers' config stack
    and torch._dynamo), a second load in the same process (the weights alone, every module
    already imported), and the bytes of the model's tensors."""
    proc = subprocess.run([sys.executable, "-c", _RSS, gguf, quantization], capture_output=True,
                          text=True, cwd=str(ROOT), env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                         "HOME": str(Path.home())})  # fmt: skip
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    log(f"RSS probe ({quantization}) failed: {proc.stderr[-500:]}")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the default model's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="ours,llama.cpp")
    ap.add_argument("--single", type=int, default=8, help="one-stream rounds (each engine once)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS_DIR / "serving_llamacpp.jsonl"))
    args = ap.parse_args()
    if args.quick:
        args.single, args.streams, args.max_tokens = 3, 16, 32
    gguf = args.gguf or default_gguf()
    head = {**base_record("serving_llamacpp"), "gguf": Path(gguf).name,
            "gguf_mib": round(Path(gguf).stat().st_size / 2**20, 1), "threads": args.threads,
            "max_tokens": args.max_tokens}  # fmt: skip
    rows: list[dict] = []
    servers: list[tuple[Server, dict]] = []
    for engine in args.engines.split(","):
        if engine in OURS:
            servers.append((ours(engine, gguf, args.threads, free_port()), head))
        elif engine == "llama.cpp":
            st = setup_llamacpp.state()
            if not st["ok"]:
                rows.append({**head, "engine": "llama.cpp", "ok": False, "error": st["error"]})
                log(f"llama.cpp: not available: {st['error'][:300]}")
                continue
            head_l = {**head, "llamacpp_build": st["build"], "llamacpp_flags": LLAMA_FLAGS}
            servers.append((llamacpp(gguf, args.threads, free_port()), head_l))
        else:
            ap.error(f"unknown engine {engine!r} (one of {', '.join([*OURS, 'llama.cpp'])})")
    rows += run_servers(servers, args)
    memory = {q: weights_rss(gguf, q) for q in ("auto", "none")}
    log(f"weights RSS (MiB): {memory}; GGUF file {head['gguf_mib']} MiB")
    for row in rows:
        row["weights_rss_mib"] = memory
        write_jsonl(args.out, row)
    log(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
