"""Median µs of one linear layer per kernel and row count, on this CPU (issue 26's table).

What decides the quantized linear's kernel choice by row count (engine/worker/quant/linear.py):
every maintained CPU kernel torch 2.13 offers, on SmolLM2-135M's shapes (and one Llama-8B
MLP shape with `--big`), at M = 1..8 and 64 rows, fp32 and bf16 activations:

    fp32 / bf16 F.linear          MKL sgemm / oneDNN (bf16 on AVX2 has no native dot product)
    fp32 / bf16 oneDNN packed     mkldnn._linear_pointwise on a weight reordered once
    fp32 torch.mv                 M = 1 only
    int8 weight-only              torch._weight_int8pack_mm (one scale per output channel)
    int4 weight-only              torch._weight_int4pack_mm_for_cpu (group 32 / 64; 576 = 9 x 64)
    int8 x int8                   torch._int_mm on activations quantized per row (+ the cost
                                  of that quantization), the 8-bit-activation route

and ours (engine/worker/quant, csrc/quant_linear*.c), which the row rule picks between:

    ours q4 kernel                q4 column groups (fp32 rows, or bf16 rows in one call)
    ours q4 dense copy + GEMM     the large-batch path: dequantized (transposed) into a
                                  scratch buffer in the activations' dtype, then F.linear
    ours q8 kernel                q8 blocks (the tied LM head)

torchao 0.18's CPU weight-only configs call the same two torch ops (its Int4CPULayout and
int8 weight-only), so they are not timed separately. Also records the memory read bandwidth
(`torch.sum` over 256 MB), the roofline every per-step figure is compared to.

    python bench/linear_kernels.py                  # 2 threads, writes bench/results/linear_kernels.jsonl
    python bench/linear_kernels.py --quick          # fewer shapes and repeats
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import RESULTS_DIR, LoadMeter, base_record, log, write_jsonl  # noqa: E402

# (name, K in, N out): SmolLM2-135M's linears and its tied LM head.
SHAPES = [
    ("qkv", 576, 960),
    ("o", 576, 576),
    ("gate_up", 576, 3072),
    ("down", 1536, 576),
    ("lm_head", 576, 49152),
]
BIG = [("llama8b_up", 4096, 14336)]
ROWS = [1, 2, 3, 4, 6, 8, 16, 24, 32, 48, 64]


def bench_us(fn, repeats: int, min_s: float = 0.02) -> float:
    """Median µs per call over `repeats` batches of calls that each last >= min_s."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-6)
    inner = max(1, int(min_s / one))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times) * 1e6


def bandwidth_gbs(repeats: int) -> float:
    x = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MB
    us = bench_us(lambda: x.sum(), repeats, min_s=0.2)
    return x.numel() * 4 / (us * 1e-6) / 1e9


def int4_pack(w: torch.Tensor, group: int, act: torch.dtype):
    """gpt-fast-style asymmetric group quantization into torch's CPU int4 layout."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    q = q.reshape(n, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    zero = lo + 8 * scale
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(act)  # [K/g, N, 2]
    return packed, sz


def kernels_for(k: int, n: int, act: torch.dtype):
    """name -> callable(x) for one weight shape and activation dtype."""
    w32 = torch.randn(n, k) * 0.02
    w = w32.to(act)
    out = {"dense F.linear": lambda x: F.linear(x, w)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
        torch.ops.mkldnn._linear_pointwise(
            torch.zeros(1, k, dtype=act), packed, None, "none", [], ""
        )
        out["oneDNN packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""
        )
    except RuntimeError:
        pass
    if act == torch.float32:
        out["torch.mv (M=1)"] = lambda x: torch.mv(w, x[0]) if x.shape[0] == 1 else None
    scale8 = (w32.abs().amax(1) / 127).clamp(min=1e-8)
    w8 = (w32 / scale8[:, None]).round().clamp(-127, 127).to(torch.int8)
    s8 = scale8.to(act)
    out["int8 weight-only"] = lambda x: torch._weight_int8pack_mm(x, w8, s8)
    for group in (32, 64):
        p4, sz = int4_pack(w32, group, act)
        out[f"int4 weight-only g{group}"] = lambda x, p4=p4, sz=sz, group=group: (
            torch._weight_int4pack_mm_for_cpu(x, p4, group, sz)
        )
    w8t = w8.t().contiguous()  # [K, N]

    def int8_int8(x):
        xs = (x.float().abs().amax(1, keepdim=True) / 127).clamp(min=1e-8)
        xq = (x.float() / xs).round().to(torch.int8)
        if xq.shape[0] <= 16:  # _int_mm wants M > 16
            xq = torch.cat([xq, xq.new_zeros(17 - xq.shape[0], xq.shape[1])])
        acc = torch._int_mm(xq, w8t)[: x.shape[0]]
        return (acc.float() * xs * scale8).to(act)

    out["int8 x int8 (_int_mm)"] = int8_int8
    out.update(ours_for(w32, act))
    return out


def ours_for(w32: torch.Tensor, act: torch.dtype):
    """Our block kernels and the dense path of engine/worker/quant/linear.py on `w32`."""
    from engine.worker.kernels import quant as qk
    from engine.worker.quant.blocks import Q4G, Q8, quantize_q4, quantize_q8, to_column_groups

    if not qk.available():
        return {}
    n, k = w32.shape
    groups = to_column_groups(quantize_q4(w32))
    q4 = qk.BoundLinear(groups, Q4G, k, None, rows=n)
    q8 = qk.BoundLinear(quantize_q8(w32).data, Q8, k, None)
    scratch = torch.empty(k, n, dtype=act)
    bf16 = act == torch.bfloat16
    return {
        "ours q4 kernel": q4.bf16 if bf16 else q4,
        "ours q4 dense copy + GEMM": lambda x: F.linear(
            x, qk.dequantize_t_into(groups, k, scratch).t()
        ),
        "ours q8 kernel": q8.bf16 if bf16 else q8,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--big", action="store_true", help="add a Llama-8B MLP shape (slow)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "linear_kernels.jsonl"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = SHAPES[-2:] if args.quick else SHAPES + (BIG if args.big else [])
    rows = [1, 4, 64] if args.quick else ROWS
    repeats = 3 if args.quick else args.repeats
    rec = base_record("linear_kernels")
    rec.update(threads=args.threads, torch=torch.__version__,
               capability=torch.backends.cpu.get_cpu_capability())  # fmt: skip
    with LoadMeter() as meter:
        rec["bandwidth_gbs"] = round(bandwidth_gbs(repeats), 1)
        log(f"memory read bandwidth {rec['bandwidth_gbs']} GB/s")
        table = []
        for act in (torch.float32, torch.bfloat16):
            for name, k, n in shapes:
                fns = kernels_for(k, n, act)
                for m in rows:
                    x = torch.randn(m, k).to(act)
                    for kernel, fn in fns.items():
                        if kernel.startswith("torch.mv") and m != 1:
                            continue
                        try:
                            us = bench_us(lambda fn=fn, x=x: fn(x), repeats)
                        except RuntimeError as exc:
                            log(f"{kernel} {act} {name} M={m}: {exc}")
                            continue
                        table.append({"act": str(act).removeprefix("torch."), "shape": name,
                                      "k": k, "n": n, "m": m, "kernel": kernel,
                                      "us": round(us, 1)})  # fmt: skip
                        log(f"{act} {name:8s} M={m:<3d} {kernel:24s} {us:10.1f} µs")
    rec["results"] = table
    rec["load"] = meter.as_dict()
    write_jsonl(args.out, rec)
    log(f"wrote {args.out} (other processes used {meter.other_cores:.2f} cores)")


if __name__ == "__main__":
    main()
