"""GPU decode benchmark: our engine with and without CUDA graphs, and transformers, in bf16.

Runs on the lent H200 from scripts/gpu_check.sh (see docs/gpu.md), on a random-weight
checkpoint of Llama-3-8B's shape generated on the machine:

  decode  model-level decode steps (metadata, forward, logits, greedy ids back to the host)
          at each batch size with 512 tokens of context, eager vs CUDA graphs (GraphRunner),
          with the backend the runner picks (FlashInfer when it works, else torch)
  w64     64 requests x (512 prompt + 256 output tokens) through LLM.generate
  hf      transformers generate() at the same batch sizes; decode tokens/s from the
          difference between a 1-token and an N-token generation

Results are merged into --out as they come (one JSON object keyed by measurement), so a run
cut short by --deadline keeps what it measured, and a rerun skips what is already there.
`--smoke --device cpu` runs the same code on tiny dims, to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.worker.attention.base import AttentionLayerSpec, AttentionMetadata, ForwardContext  # noqa: E402

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
)  # fmt: skip
SMOKE = dict(
    LLAMA3_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
)  # fmt: skip
BLOCK = 16
CONTEXT = 512


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _release(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ---- checkpoint -----------------------------------------------------------------------------
def make_checkpoint(out: Path, dims: dict, dev: torch.device) -> Path:
    """Random bf16 Llama safetensors of `dims` (one shard per layer) plus a small tokenizer."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from tests.support.tiny_models import make_tokenizer

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    cfg = LlamaConfig(**dims, bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["LlamaForCausalLM"]
    gen = torch.Generator(device=dev).manual_seed(0)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    index: dict[str, str] = {}

    def rand(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        return t.normal_(0.0, 0.02, generator=gen).cpu()

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=torch.bfloat16)

    shard("embed.safetensors", {"model.embed_tokens.weight": rand(cfg.vocab_size, h)})
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        shard(f"layer{n:02d}.safetensors", {
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones(),
        })  # fmt: skip
    shard(
        "head.safetensors", {"model.norm.weight": ones(), "lm_head.weight": rand(cfg.vocab_size, h)}
    )
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index})
    )
    cfg.save_pretrained(out)  # last: its presence marks a complete checkpoint
    return out


# ---- model-level decode ---------------------------------------------------------------------
def decode_metadata(tables: np.ndarray, seq_len: int, dev: torch.device) -> AttentionMetadata:
    """A decode step for every row of `tables`, each request holding `seq_len` tokens after it."""
    n, pos = tables.shape[0], seq_len - 1
    slots = tables[:, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK

    def to(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype)

    return AttentionMetadata(
        num_reqs=n, num_tokens=n, query_start_loc=to(np.arange(n + 1), torch.int32),
        seq_lens=to(np.full(n, seq_len), torch.int32), block_tables=to(tables, torch.int32),
        slot_mapping=to(slots, torch.int64), positions=to(np.full(n, pos), torch.int64),
        max_query_len=1, max_seq_len=seq_len, query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=[seq_len] * n, block_size=BLOCK,
    )  # fmt: skip


@torch.inference_mode()
def _decode_rate(model, backend, caches, gr, dev, batch: int, per_seq: int, steps: int) -> dict:
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    ids = torch.randint(0, 1000, (batch,), device=dev)
    warm = 3
    for s in range(warm + steps):
        if s == warm:
            _sync(dev)
            t0 = time.perf_counter()
        md = decode_metadata(tables, CONTEXT + s + 1, dev)
        if gr is not None:
            hidden = gr.run(
                SimpleNamespace(input_ids=ids, positions=md.positions, attn_metadata=md)
            )
        else:
            backend.begin_step(md)
            hidden = model(ids, md.positions, ForwardContext(md, caches, backend))
        nxt = model.compute_logits(hidden).argmax(-1).tolist()  # host round trip, like sampling
        ids = torch.tensor(nxt, device=dev)
    dt = time.perf_counter() - t0
    return dict(tokens_per_s=round(batch * steps / dt, 1), ms_per_step=round(1e3 * dt / steps, 3))


def bench_decode(model_dir: Path, dev: torch.device, batches: list[int], steps: int, res: dict,
                 save, deadline: float) -> None:  # fmt: skip
    from engine.config import ModelConfig
    from engine.worker.decode_graphs import GraphRunner
    from engine.worker.models.loader import load_model
    from engine.worker.runner import select_attention_backend
    from graphs.buckets import capture_sizes

    model = load_model(ModelConfig(path=str(model_dir), dtype="bfloat16"), dev).model
    backend = select_attention_backend(dev)
    res["decode_backend"] = backend.name
    per_seq = math.ceil((CONTEXT + steps + 8) / BLOCK)
    max_b = max(batches)
    shape = (max_b * per_seq, 2, BLOCK, model.num_kv_heads, model.head_dim)
    caches = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(model.num_layers)]
    modes = ["eager"]
    if dev.type == "cuda" and getattr(backend, "supports_cuda_graphs", False):
        modes.append("graphs")
    else:
        res["decode_graphs_skipped"] = f"{backend.name} on {dev.type}: no graph-safe decode path"
    for mode in modes:
        gr = None
        if mode == "graphs":
            sizes = capture_sizes(None, max_b)
            gr = GraphRunner(model, backend, caches, sizes, dev, block_size=BLOCK,
                             max_blocks_per_seq=per_seq)  # fmt: skip
            st = gr.capture()
            res["graph_capture"] = dict(seconds=round(st.capture_seconds, 2), buckets=len(sizes),
                                        memory_mib=round(st.graph_memory_bytes / 2**20))  # fmt: skip
        for b in batches:
            key = f"decode_{mode}_b{b}"
            if key not in res and time.monotonic() < deadline:
                res[key] = _decode_rate(model, backend, caches, gr, dev, b, per_seq, steps)
                save()
        del gr
    del model, caches
    _release(dev)


# ---- engine-level throughput ----------------------------------------------------------------
def bench_w64(model_dir: Path, dev: torch.device, res: dict, save, deadline: float,
              graphs: bool, prompt: int = 512, output: int = 256) -> None:  # fmt: skip
    from engine import LLM, SamplingParams

    key = f"w64_{'graphs' if graphs else 'eager'}"
    if key in res or time.monotonic() > deadline:
        return
    llm = LLM(str(model_dir), dtype="bfloat16", device=dev.type, max_model_len=1024,
              max_num_seqs=256, max_num_batched_tokens=8192, cuda_graphs=graphs)  # fmt: skip
    runner = llm.engine.runner
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, prompt).tolist() for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    _sync(dev)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    res[key] = dict(
        seconds=round(dt, 2), output_tokens_per_s=round(gen / dt, 1),
        total_tokens_per_s=round((gen + 64 * prompt) / dt, 1), backend=runner.backend.name,
        graph_runner=type(getattr(runner, "graph_runner", None)).__name__,
    )  # fmt: skip
    save()
    del llm, runner
    _release(dev)


def _timed_generate(model: Any, ids: torch.Tensor, n: int) -> float:
    _sync(ids.device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                   do_sample=False, pad_token_id=0)  # fmt: skip
    _sync(ids.device)
    return time.perf_counter() - t0


def bench_hf(model_dir: Path, dev: torch.device, batches: list[int], new_tokens: int, res: dict,
             save, deadline: float) -> None:  # fmt: skip
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa", device_map=dev.type
    ).eval()
    for b in batches:
        key = f"hf_b{b}"
        if key in res or time.monotonic() > deadline:
            continue
        ids = torch.randint(3, 1000, (b, CONTEXT), device=dev)
        _timed_generate(hf, ids, 2)  # warm-up
        t1, tn = _timed_generate(hf, ids, 1), _timed_generate(hf, ids, new_tokens)
        res[key] = dict(decode_tokens_per_s=round(b * (new_tokens - 1) / (tn - t1), 1),
                        ms_per_step=round(1e3 * (tn - t1) / (new_tokens - 1), 3))  # fmt: skip
        save()
    del hf
    _release(dev)


# ---- FlashInfer JIT warm-up -----------------------------------------------------------------
def warm_jit(kind: str) -> None:
    """Build one FlashInfer kernel family ahead of the tests (a JIT compile takes minutes)."""
    from engine.worker.attention.flashinfer import FlashInferBackend
    from tests.support.paged_harness import build_metadata

    dev = torch.device("cuda")
    prefill, window = kind.startswith("prefill"), kind.endswith("window")
    backend = FlashInferBackend(dev)
    spec = AttentionLayerSpec(32, 8, 128, 128**-0.5, sliding_window=8 if window else None)
    cache = torch.zeros(8, 2, BLOCK, 8, 128, dtype=torch.bfloat16, device=dev)
    md = build_metadata([3, 2] if prefill else [1, 1], [20, 5], [[1, 2], [3]], BLOCK, device=dev)
    q = torch.randn(md.num_tokens, 32, 128, dtype=torch.bfloat16, device=dev)
    kv = torch.randn(md.num_tokens, 8, 128, dtype=torch.bfloat16, device=dev)
    t0 = time.perf_counter()
    backend.begin_step(md)
    backend.forward(q, kv, kv, cache, md, spec)
    torch.cuda.synchronize()
    print(f"flashinfer {kind} kernels ready in {time.perf_counter() - t0:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_decode.json"
    )
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/llama3-8b-random"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny dims (checks the script on a CPU)")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--hf-new-tokens", type=int, default=16)
    ap.add_argument("--deadline", type=float, default=420.0, help="seconds from start")
    ap.add_argument("--only", default="decode,w64,hf,w64eager", help="parts to run, in order")
    ap.add_argument("--warm-jit", choices=["decode", "prefill", "decode-window", "prefill-window"])
    args = ap.parse_args()
    if args.warm_jit:
        return warm_jit(args.warm_jit)
    start = time.monotonic()
    deadline = start + args.deadline
    dev = torch.device(args.device)
    res: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    res.update(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               torch=torch.__version__)  # fmt: skip

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, sort_keys=True))

    t0 = time.perf_counter()
    model_dir = make_checkpoint(args.model_dir, SMOKE if args.smoke else LLAMA3_8B, dev)
    res.setdefault("checkpoint_seconds", round(time.perf_counter() - t0, 1))
    batches = [int(b) for b in args.batches.split(",")]
    parts = {
        "decode": lambda: bench_decode(model_dir, dev, batches, args.steps, res, save, deadline),
        "w64": lambda: bench_w64(model_dir, dev, res, save, deadline, graphs=True),
        "hf": lambda: bench_hf(model_dir, dev, batches, args.hf_new_tokens, res, save, deadline),
        "w64eager": lambda: bench_w64(model_dir, dev, res, save, deadline, graphs=False),
    }
    for part in filter(None, args.only.split(",")):
        if time.monotonic() > deadline:
            res.setdefault("skipped_for_time", []).append(part)
            continue
        try:
            parts[part]()
        except Exception as e:  # noqa: BLE001 - record it and go on to the next measurement
            res[f"{part}_error"] = f"{type(e).__name__}: {e}"[:2000]
        save()
    res["wall_seconds"] = round(time.monotonic() - start, 1)
    save()
    print(json.dumps(res, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
