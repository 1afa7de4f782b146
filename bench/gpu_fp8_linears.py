"""fp8 e4m3 linears (engine/worker/quant/fp8.py) against bf16: the linears part of the `fp8`
phase of scripts/gpu_check.sh (bench/gpu_phases.py calls `fp8_linears_check`).

The first device run (H100, 2026-12-06) timed both eagerly at batch 1 only: fp8 0.81x bf16,
a step launch-bound (bf16 eager 28 ms, under graphs 9.5 ms), so it said nothing about the
goal (fp8 batch-1 decode >= 1.6x bf16). What this measures instead, on the phase's random
Llama-3-8B-shaped bf16 model:

  layers     per Llama-3-8B linear (fused QKV 4096->6144, O 4096->4096, fused gate/up
             4096->28672, down 14336->4096) at 1, 8 and 64 rows: us per call of bf16
             F.linear, of the fp8 path whole, of its activation quantization alone and of
             `_scaled_mm` alone, each recorded REPS times into a CUDA graph over weight
             copies that do not fit in L2 together, so every call reads HBM and no launch
             is timed; and the weight-read bandwidth each call reaches
  exactness  Fp8Linear's output against the same product in fp32 on its own dequantized
             operands: max |err| / max |ref| within EXACT_TOL (a bf16 output is within
             2**-9 of its value); a transposed operand or a scale on the wrong axis is off
             by O(1). The only verdict here: random weights grade no fidelity
  fidelity   teacher-forced: 4 sequences, 32 greedy bf16 decode steps; the fp8 model is fed
             the same tokens: mean / max |delta log p| of the reference token, argmax
             agreement (reported; random N(0, 0.02) weights amplify any perturbation)
  decode     tok/s at batch 1, 8 and 64, context 512, eager and graphs, bf16 then fp8
             linears, each graph step also replayed without the host's sampling round trip
             (`replay_ms`), and the batch-1 roofline of the weights each reads

The dry run (CPU) runs the same code on TINY dims: no graphs (plain timing), and Fp8Linear's
CPU reference path, which multiplies the dequantized weights without quantizing x.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# (name, in_features, out_features): Llama-3-8B's linears as the engine fuses them.
LLAMA3_8B_LINEARS = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
                     ("down", 14336, 4096)]  # fmt: skip
TINY_LINEARS = [("qkv", 64, 128), ("down", 128, 64)]
ROWS = [1, 8, 64]
REPS = 20
EXACT_TOL = 2.0**-7


def _per_call_us(fns: list[Callable[[], Any]], dev: torch.device, reps: int) -> float:
    """us per call of `fns` taken in turn, `reps` calls recorded into one CUDA graph and
    replayed (on the CPU: timed directly)."""

    def body() -> None:
        for i in range(reps):
            fns[i % len(fns)]()

    if dev.type != "cuda":
        body()
        t0 = time.perf_counter()
        body()
        return round(1e6 * (time.perf_counter() - t0) / reps, 2)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up off the capture: cuBLAS picks its kernels here
        body()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize(dev)
    return round(1e3 * start.elapsed_time(end) / (5 * reps), 2)


def _fp8_layer(w: torch.Tensor) -> Any:
    from engine.worker.quant.fp8 import Fp8Linear

    layer = Fp8Linear(w.shape[1], w.shape[0], False, target=None, dtype=w.dtype).to(w.device)
    layer.load_tensor("weight", None, w)
    layer.finalize()
    return layer


@torch.inference_mode()
def layer_costs(dev: torch.device, dry: bool) -> dict[str, Any]:
    """us per call and GB/s of weight read: bf16, fp8 whole, its quantization, `_scaled_mm`."""
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else 0
    out: dict[str, Any] = {}
    gen = torch.Generator(dev).manual_seed(0)
    for name, k, n in TINY_LINEARS if dry else LLAMA3_8B_LINEARS:
        copies = max(1, math.ceil(4 * l2 / (k * n)))  # fp8 bytes of the copies >= 4x L2
        ws = [torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
              for _ in range(copies)]  # fmt: skip
        layers = [_fp8_layer(w) for w in ws]
        for m in ROWS:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            out[f"{name}_m{m}"] = _row_costs(x, ws, layers, dev)
        del ws, layers
    return out


def _row_costs(x: torch.Tensor, ws: list[torch.Tensor], layers: list, dev) -> dict[str, Any]:
    from engine.worker.quant.fp8 import quantize_fp8_activations

    k, n = ws[0].shape[1], ws[0].shape[0]
    xq, xs = quantize_fp8_activations(x)

    def scaled_mm(ly) -> torch.Tensor:
        return torch._scaled_mm(xq, ly.fp8_weight.t(), scale_a=xs, scale_b=ly.fp8_scale,
                                out_dtype=torch.bfloat16)  # fmt: skip

    row: dict[str, Any] = {
        "bf16_us": _per_call_us([lambda w=w: F.linear(x, w) for w in ws], dev, REPS),
        "fp8_us": _per_call_us([lambda ly=ly: ly(x) for ly in layers], dev, REPS),
        "quant_us": _per_call_us([lambda: quantize_fp8_activations(x)], dev, REPS),
        "scaled_mm_us": _per_call_us([lambda ly=ly: scaled_mm(ly) for ly in layers], dev, REPS),
    }
    row["bf16_gbps"] = round(2 * k * n / row["bf16_us"] / 1e3, 1)
    row["fp8_gbps"] = round(k * n / row["fp8_us"] / 1e3, 1)
    row["fp8_over_bf16"] = round(row["bf16_us"] / row["fp8_us"], 2)
    return row


@torch.inference_mode()
def exactness(dev: torch.device, dry: bool) -> float:
    """max |Fp8Linear(x) - ref| / max |ref| for the fused gate/up shape at 8 rows, ref the
    product in fp32 of the operands the layer multiplies (on the CPU, the unquantized x)."""
    from engine.worker.quant.fp8 import quantize_fp8_activations

    _, k, n = TINY_LINEARS[0] if dry else LLAMA3_8B_LINEARS[2]  # the fused gate/up
    gen = torch.Generator(dev).manual_seed(1)
    layer = _fp8_layer(torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02)
    x = torch.randn(8, k, device=dev, generator=gen, dtype=torch.bfloat16)
    y = layer(x).float()
    if dev.type == "cuda":
        xq, xs = quantize_fp8_activations(x)
        xf = xq.float() * xs
    else:
        xf = x.float()
    w = layer.fp8_weight.float() * layer.fp8_scale.view(-1, 1)
    ref = xf @ w.t()
    return float((y - ref).abs().max() / ref.abs().max())


@torch.inference_mode()
def decode_logprobs(model, backend, dev: torch.device, steps: int,
                    feed: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:  # fmt: skip
    """4 sequences decoded from fixed start tokens: each step's log-softmax (fp32, on the host)
    and the tokens fed next (greedy, or `feed`'s)."""
    from bench.gpu_decode import BLOCK, decode_metadata
    from engine.worker.attention.base import ForwardContext

    batch, per_seq = 4, -(-(steps + 1) // BLOCK)
    dtype = next(model.parameters()).dtype
    shape = (batch * per_seq, 2, BLOCK, model.num_kv_heads, model.head_dim)
    kv = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(model.num_layers)]
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    start = [t % model.vocab_size for t in (7, 100, 1000, 5000)]
    ids, tokens, logps = torch.tensor(start, device=dev), [], []
    for s in range(steps):
        md = decode_metadata(tables, s + 1, dev)
        backend.begin_step(md)
        hidden = model(ids, md.positions, ForwardContext(md, kv, backend))
        lp = torch.log_softmax(model.compute_logits(hidden).float(), -1).cpu()
        logps.append(lp)
        nxt = feed[s] if feed is not None else lp.argmax(-1).tolist()
        tokens.append(nxt)
        ids = torch.tensor(nxt, device=dev)
    return tokens, logps


def teacher_forced(ref: tuple, got: list[torch.Tensor]) -> dict[str, Any]:
    tokens, ref_lp = ref
    d_tok, agree = [], 0
    for toks, a, b in zip(tokens, ref_lp, got, strict=True):
        idx = torch.tensor(toks).view(-1, 1)
        d_tok.append((a.gather(1, idx) - b.gather(1, idx)).abs().flatten())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
    d = torch.cat(d_tok)
    return dict(positions=d.numel(), mean_dlogp_token=round(float(d.mean()), 5),
                max_dlogp_token=round(float(d.max()), 4),
                argmax_agreement=round(agree / d.numel(), 4))  # fmt: skip


def fp8_linears_check(model, dev: torch.device, dry: bool, save: Callable[[], None],
                      res: dict[str, Any]) -> None:  # fmt: skip
    """Fills `res` part by part (saved after each); converts `model`'s linears in place.
    The parts (exactness, layers, decode) run whatever the others did, each error kept in
    `res["errors"]`; raises at the end when any failed, the exactness verdict included."""
    from bench.gpu_decode import run_parts

    def exact() -> None:
        res["exact_rel_err"] = exactness(dev, dry)
        save()
        if not res["exact_rel_err"] <= EXACT_TOL:
            raise AssertionError(
                f"Fp8Linear differs from its own operands' fp32 product by "
                f"{res['exact_rel_err']:.3g} of the largest output (> {EXACT_TOL:.3g}): a wrong"
                " layout or scale axis"
            )

    def layers() -> None:
        res["layers"] = layer_costs(dev, dry)
        save()

    failed = run_parts(
        {
            "exactness": exact,
            "layers": layers,
            "decode": lambda: _decode(model, dev, dry, save, res),
        },
        res,
    )
    save()
    if failed:
        raise RuntimeError("; ".join(f"{name}: {res['errors'][name]}" for name in failed))


def _decode(model, dev: torch.device, dry: bool, save: Callable[[], None], res: dict) -> None:
    """bf16 decode, teacher-forced reference, the linears to fp8, the same again."""
    from bench.gpu_decode import decode_modes, roofline_b1
    from engine.worker.attention.selection import select_attention_backend
    from engine.worker.quant.fp8 import to_fp8

    backend = select_attention_backend(
        dev, torch.bfloat16, specs=model.attention_specs, block_size=16
    ).backend
    res["backend"] = backend.name
    steps = 4 if dry else 32
    ref = decode_logprobs(model, backend, dev, steps)
    batches, context, dsteps = ([1, 4], 40, 3) if dry else ([1, 8, 64], 512, 32)
    decode_modes(model, backend, dev, batches, context, dsteps, res, save, key="bf16")
    bf16_bytes = _weight_bytes(model)
    res["fp8_linears"] = to_fp8(model)
    fp8_bytes = _weight_bytes(model)
    res["weight_gib"] = {"bf16": round(bf16_bytes / 2**30, 2), "fp8": round(fp8_bytes / 2**30, 2)}
    res["fidelity"] = teacher_forced(ref, decode_logprobs(model, backend, dev, steps, ref[0])[1])
    save()
    decode_modes(model, backend, dev, batches, context, dsteps, res, save, key="fp8")
    res["fp8_over_bf16"] = {
        f"{mode}_b{b}{tail}": round(
            res[f"bf16_{mode}_b{b}"][field] / res[f"fp8_{mode}_b{b}"][field], 3
        )
        for mode in ("eager", "graphs") for b in batches
        for tail, field in (("", "ms_per_step"), ("_replay", "replay_ms"))
        if field in res.get(f"fp8_{mode}_b{b}", {}) and field in res.get(f"bf16_{mode}_b{b}", {})
    }  # fmt: skip
    if dev.type == "cuda" and "fp8_graphs_b1" in res:
        res["roofline_b1"] = {
            key: roofline_b1(nbytes, res[f"{key}_graphs_b1"]["replay_ms"], dev)
            for key, nbytes in (("bf16", bf16_bytes), ("fp8", fp8_bytes))
        }


def _weight_bytes(model) -> int:
    """Bytes a batch-1 step reads: parameters and the fp8 buffers (embedding rows aside,
    they are read one row a token; the LM head is counted, it stays bf16)."""
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "embed_tokens" in name or not t.is_floating_point() or t.dim() < 2:
            continue
        total += t.numel() * t.element_size()
    return total
