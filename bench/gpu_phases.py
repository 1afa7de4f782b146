"""The Python phases of scripts/gpu_check.sh (the shell runs each under its own timeout).

    python bench/gpu_phases.py PHASE --work DIR [--dry-run]

  setup   versions: GPU, driver, nvcc, the machine's torch (not the image's), flashinfer,
          tvm-ffi, transformers; on CUDA, flashinfer must import
  jit     builds the FlashInfer modules the backend needs (engine.worker.attention.
          flashinfer_aot, MAX_JOBS jobs, seconds per module), then times the backend's first
          decode and prefill with Llama-3-8B's head layout (no compile left to do)
  kv      Llama-3-8B's shape (random bf16 weights in GPU memory): KV sizing at
          memory_fraction 0.9 with 256 sequences, then a step of 256 requests sampled with
          top-p and scored with prompt logprobs, out of memory or not; then the engine's
          own loop (Scheduler + runner) at batch 1 and 64: ms per pure decode step
  served  `appliance serve` on the device with a tiny checkpoint: /health green, one
          streamed chat completion over HTTP, one gRPC Generate stream
  fp8     Llama-3-8B's shape (random bf16 weights): fp8 KV pages against bf16 pages
          (bench/gpu_fp8_kv.py: JIT, teacher-forced log-probs, decode tok/s at batch 1/64),
          then fp8 e4m3 linears against bf16 (bench/gpu_fp8_linears.py: per-layer cost
          under graphs, exactness, teacher-forced log-probs, decode at batch 1/8/64)
  report  merges DIR/*.json and DIR/phases.tsv into $OUT/gpu_check.json

Each phase writes DIR/<phase>.json and exits 1 on any error (traceback on stderr); a phase
made of parts (fp8) records each part's error under "errors", writes what it measured and
exits 1.
`--dry-run`: the same code on the CPU, tiny shapes, the torch backend.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_GIB = 1 << 30
IMAGE_TORCH = "2.13.0"  # Containerfile's TORCH_VERSION


def _device(dry: bool) -> Any:
    import torch

    return torch.device("cpu" if dry else "cuda")


def _cmd(*args: str) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable: {e}"


def phase_setup(dry: bool) -> dict:
    import torch
    import transformers

    res: dict[str, Any] = dict(
        python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
        transformers=transformers.__version__, cpus=os.cpu_count(),
        torch_note=f"the check ran on this machine's torch {torch.__version__}; the image pins "
        f"torch {IMAGE_TORCH}, which this run does not prove",
    )  # fmt: skip
    if not dry:
        res["gpu"] = torch.cuda.get_device_name(0)
        res["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        res["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / _GIB, 1)
        res["driver"] = _cmd("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        res["nvcc"] = _cmd(os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), "-V")
        res["nvcc"] = res["nvcc"].splitlines()[-1] if res["nvcc"] else "not found"
    for mod in ("flashinfer", "tvm_ffi"):
        try:
            res[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as e:  # noqa: BLE001 - recorded; fatal below on CUDA
            res[mod] = f"not importable: {type(e).__name__}: {e}"
            if not dry:
                raise
    return res


def _head_layout_forward(backend, dev, dtype, decode: bool) -> float:
    """Seconds of one plan + run with Llama-3-8B's heads (32 q, 8 kv, dim 128)."""
    import torch

    from engine.worker.attention.base import AttentionLayerSpec
    from tests.support.paged_harness import build_metadata

    spec = AttentionLayerSpec(32, 8, 128, 128**-0.5)
    cache = torch.zeros(8, 2, 16, 8, 128, dtype=dtype, device=dev)
    md = build_metadata([1, 1] if decode else [3, 2], [20, 5], [[1, 2], [3]], 16, device=dev)
    q = torch.randn(md.num_tokens, 32, 128, dtype=dtype, device=dev)
    kv = torch.randn(md.num_tokens, 8, 128, dtype=dtype, device=dev)
    t0 = time.perf_counter()
    backend.begin_step(md)
    out = backend.forward(q, kv, kv, cache, md, spec)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if not bool(torch.isfinite(out).all()):
        raise RuntimeError("attention output is not finite")
    return time.perf_counter() - t0


def phase_jit(dry: bool) -> dict:
    import torch

    from engine.worker.attention import flashinfer_aot as aot
    from engine.worker.attention.selection import select_attention_backend

    dev, dtype = _device(dry), torch.bfloat16
    modules = aot.required_modules([128], [dtype])
    res: dict[str, Any] = dict(
        modules=[m.name for m in modules], max_jobs=os.environ.get("MAX_JOBS"),
        arch_list=os.environ.get("FLASHINFER_CUDA_ARCH_LIST"),
    )  # fmt: skip
    if not dry:
        from flashinfer.jit.attention import modules as fi_modules

        t0 = time.perf_counter()
        res["built"] = aot.build_all(modules, fi_modules)
        res["build_seconds"] = round(time.perf_counter() - t0, 1)
    # flashinfer on the GPU: a failure stops the phase with its reason (no silent fallback)
    choice = select_attention_backend(dev, dtype, setting="torch" if dry else "flashinfer")
    backend = choice.backend
    res["backend"] = backend.name
    if not dry and backend.name != "flashinfer":
        raise RuntimeError(f"the runner picked the {backend.name} backend, not flashinfer")
    res["first_decode_seconds"] = round(_head_layout_forward(backend, dev, dtype, True), 3)
    res["first_prefill_seconds"] = round(_head_layout_forward(backend, dev, dtype, False), 3)
    return res


def phase_kv(dry: bool) -> dict:
    """KV sizing at 0.9 with 256 sequences, then one top-p step of 256 requests."""
    import torch

    from bench.gpu_decode import run_parts
    from bench.random_model import LLAMA3_8B, TINY, random_model
    from engine.config import CacheConfig, RuntimeConfig, SchedulerConfig
    from engine.core.step_io import NewRequestData, SchedulerOutput
    from engine.sampling_params import SamplingParams
    from engine.worker.kv_sizing import (
        KVGeometry,
        profile_kv_blocks,
        profile_step,
        size_gpu_kv_cache,
    )
    from engine.worker.runner import ModelRunner

    dev, dtype, block = _device(dry), torch.bfloat16, 16
    dims = TINY if dry else LLAMA3_8B
    max_len = 8192 if not dry else 1024
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192 if not dry else 512)
    model = random_model(dims, dev, dtype)
    runner = ModelRunner(model, dev, dtype, block, RuntimeConfig(device=dev.type))
    geom = KVGeometry(model.num_layers, block, model.num_kv_heads, model.head_dim, dtype)
    res: dict[str, Any] = dict(memory_fraction=0.9, max_num_seqs=256, backend=runner.backend.name)
    t0 = time.perf_counter()
    if dry:  # the profiling step itself; the peak around it is CUDA's
        runner.allocate_kv_cache(profile_kv_blocks(sched, block, max_len))
        profile_step(runner, sched, block, max_len)
        blocks = 4 * profile_kv_blocks(sched, block, max_len)
    else:
        cache = CacheConfig(memory_fraction=0.9, block_size=block)
        blocks = size_gpu_kv_cache(runner, cache, sched, geom, max_len)
    res["sizing_seconds"] = round(time.perf_counter() - t0, 1)
    res["kv_blocks"] = blocks
    res["kv_gib"] = round(blocks * geom.bytes_per_block / _GIB, 2)
    runner.allocate_kv_cache(blocks)
    runner.capture_graphs(256, max_len)
    # One step as wide as the scheduler allows: 256 requests, top-p, prompt logprobs.
    per = sched.max_num_batched_tokens // 256
    params = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, prompt_logprobs=20)
    so = SchedulerOutput(total_num_scheduled_tokens=256 * per)
    per_blocks = -(-per // block)
    for i in range(256):
        rid = f"kv-{i}"
        ids = list(range(i * per_blocks, (i + 1) * per_blocks))
        so.scheduled_new_reqs.append(NewRequestData(rid, [3] * per, [], params, ids, 0))
        so.num_scheduled_tokens[rid] = per
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    out = runner.execute(so)
    if len(out.sampled_token_ids) != 256:
        raise RuntimeError(f"{len(out.sampled_token_ids)} sampled rows, expected 256")
    res["top_p_step"] = "ok: 256 rows sampled"
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        res.update(
            total_gib=round(total / _GIB, 1), free_after_gib=round(free / _GIB, 2),
            peak_allocated_gib=round(torch.cuda.max_memory_allocated(dev) / _GIB, 2),
            graphs=type(runner.graph_runner).__name__,
        )  # fmt: skip
    # The engine's own loop on the same runner: the batch-1 and batch-64 decode steps as a
    # served request takes them (scheduler, input preparation, graphs, sampling, host
    # round trip), to set beside the decode phase's bare model steps.
    # An error here is recorded (the phase fails) without losing the figures above.
    runner.execute(SchedulerOutput(finished_req_ids={f"kv-{i}" for i in range(256)}))

    def loop(batch: int) -> None:
        res[f"engine_decode_b{batch}"] = engine_loop(
            runner, blocks, block, max_len, batch, 512 if not dry else 40, 32 if not dry else 4
        )

    run_parts({f"engine_decode_b{b}": functools.partial(loop, b) for b in (1, 64)}, res)
    return res


def engine_loop(runner, blocks: int, block: int, max_len: int, batch: int, prompt_len: int,
                new_tokens: int) -> dict:  # fmt: skip
    """`batch` greedy requests of `prompt_len` tokens, `new_tokens` each, through the real
    Scheduler and `runner.execute` (what LLMEngine.step does, less detokenizing): the median
    ms of the steps that were pure decode (one token per request), and how many there were."""
    from engine.config import SchedulerConfig
    from engine.core.kv_cache.manager import KVCacheManager
    from engine.core.request import Request
    from engine.core.scheduler import Scheduler
    from engine.sampling_params import SamplingParams

    kv = KVCacheManager(blocks, block, False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max(batch, 2), max_num_batched_tokens=8192),
                      kv, max_len)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        sched.add_request(Request(f"loop-{batch}-{i}", [3 + i % 50] * prompt_len, params))
    decode: list[float] = []
    while sched.has_unfinished_requests():
        t0 = time.perf_counter()
        so = sched.schedule()
        out = runner.execute(so)
        sched.update_from_output(so, out)
        if so.total_num_scheduled_tokens == batch and not so.scheduled_new_reqs:
            decode.append(time.perf_counter() - t0)
    runner.execute(sched.schedule())  # the last step's finished ids: the runner lets them go
    decode.sort()
    return dict(steps=len(decode), ms_per_step=round(1e3 * decode[len(decode) // 2], 3))


def phase_served(dry: bool) -> dict:
    """`appliance serve` on the device: health, one streamed chat, one gRPC stream."""
    import asyncio

    import grpc
    import httpx

    from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
    from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
    from tests.support.served_stack import spawn_serve, tiny_serve_sets
    from tests.support.tiny_models import make_tiny_checkpoint

    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # head_dim 128, GQA group 4: the kernels the jit phase built.
        path = make_tiny_checkpoint(Path(tmp) / "tiny", "llama", hidden_size=256,
                                    num_attention_heads=4, num_key_value_heads=1, head_dim=128)  # fmt: skip
        sets = {"runtime.device": "cpu" if dry else "cuda"}
        if not dry:
            sets.update({"model.dtype": "bfloat16", "scheduler.max_num_seqs": 8})
        t0 = time.perf_counter()
        sp = spawn_serve(["serve", *tiny_serve_sets(path, **sets)], timeout=240)
        try:
            res["start_seconds"] = round(time.perf_counter() - t0, 1)
            health = httpx.get(f"{sp.url}/health", timeout=30)
            res["health"] = health.status_code
            if health.status_code != 200:
                raise RuntimeError(f"/health answered {health.status_code}: {health.text}")
            body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
            chunks = 0
            with httpx.stream("POST", f"{sp.url}/v1/chat/completions", json=body, timeout=60) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"chat completion answered {r.status_code}")
                for line in r.iter_lines():
                    chunks += line.startswith("data: ") and line != "data: [DONE]"
            res["http_stream_chunks"] = chunks

            async def grpc_call() -> list:
                async with grpc.aio.insecure_channel(sp.grpc_address) as ch:
                    req = pb.GenerateRequest(text="Hello", request_id="gpu-check",
                                             sampling=pb.SamplingParams(temperature=0, max_tokens=4,
                                                                        ignore_eos=True))  # fmt: skip
                    return [x async for x in pb_grpc.ApplianceStub(ch).Generate(req, timeout=60)]

            replies = asyncio.run(grpc_call())
            res["grpc_messages"] = len(replies)
            res["grpc_completion_tokens"] = replies[-1].usage.completion_tokens
            if res["grpc_completion_tokens"] != 4 or chunks < 2:
                raise RuntimeError(f"unexpected stream lengths: {res}")
        finally:
            sp.kill()
    return res


def phase_fp8(dry: bool, work: Path) -> dict:
    """On one random Llama-3-8B-shaped bf16 model: fp8 KV pages vs bf16 pages
    (bench/gpu_fp8_kv.py), then fp8 e4m3 linears vs bf16 (bench/gpu_fp8_linears.py). Each part's
    error is recorded and the phase fails after both ran."""
    import torch

    from bench.gpu_decode import run_parts
    from bench.gpu_fp8_kv import fp8_kv_check
    from bench.gpu_fp8_linears import fp8_linears_check
    from bench.random_model import LLAMA3_8B, TINY, random_model

    dev, dtype = _device(dry), torch.bfloat16
    model = random_model(TINY if dry else LLAMA3_8B, dev, dtype)
    res: dict[str, Any] = {"dims": "tiny" if dry else "llama3-8b", "kv_pages": {}, "linears": {}}

    def save() -> None:  # a phase cut short by its timeout keeps what it measured
        work.mkdir(parents=True, exist_ok=True)
        (work / "fp8.json").write_text(json.dumps(res, indent=1, sort_keys=True))

    run_parts({
        "kv_pages": lambda: fp8_kv_check(model, dev, dry, save, res["kv_pages"]),
        "linears": lambda: fp8_linears_check(model, dev, dry, save, res["linears"]),
    }, res)  # fmt: skip
    return res


PHASES = {"setup": phase_setup, "jit": phase_jit, "kv": phase_kv, "served": phase_served,
          "fp8": phase_fp8}  # fmt: skip


def report(work: Path, out: Path) -> dict:
    """One JSON: each phase's status, seconds and results (from the shell's phases.tsv)."""
    phases = {}
    tsv = work / "phases.tsv"
    for line in tsv.read_text().splitlines() if tsv.exists() else []:
        name, rc, seconds = line.split("\t")[:3]
        status = "ok" if rc == "0" else ("timeout" if rc in ("124", "137") else "error")
        entry: dict[str, Any] = dict(status=status, exit=int(rc), seconds=float(seconds))
        result = work / f"{name}.json"
        if result.exists():
            entry["result"] = json.loads(result.read_text())
        phases[name] = entry
    merged = dict(phases=phases, ok=bool(phases) and all(p["exit"] == 0 for p in phases.values()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(merged, indent=1, sort_keys=True))
    return merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("phase", choices=[*PHASES, "report"])
    ap.add_argument("--work", type=Path, required=True, help="per-phase JSON and phases.tsv")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, torch backend")
    args = ap.parse_args(argv)
    if args.phase == "report":
        return 0 if report(args.work, args.out)["ok"] else 1
    phase = PHASES[args.phase]
    res = phase(args.dry_run, args.work) if args.phase == "fp8" else phase(args.dry_run)
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / f"{args.phase}.json").write_text(json.dumps(res, indent=1, sort_keys=True))
    print(json.dumps(res, sort_keys=True))
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
