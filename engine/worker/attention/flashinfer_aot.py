"""Build ahead of time the FlashInfer kernels `FlashInferBackend` uses, so nothing JITs later.

FlashInfer 0.7 compiles each kernel family with nvcc on first use (minutes per family). The
backend needs, per head dim, in bf16 and fp16 caches with int32 indices, no positional
encoding in the kernel, no sliding window, no soft cap:

  decode         `BatchDecodeWithPagedKVCacheWrapper` without tensor cores (GQA group < 4)
  prefill-fa2    `BatchPrefillWithPagedKVCacheWrapper(backend="fa2")`, and the decode wrapper
                 with tensor cores (GQA group >= 4), which runs the same FA2 prefill kernels

Windowed or soft-capped layers (Gemma 2/3, Mistral's window) still JIT on first use.
fp8 KV pages (`cache.kv_dtype: fp8_e4m3`) are the same kernels instantiated with an e4m3
KV type: `--kv-dtypes auto,float8_e4m3fn` adds them (named `...-kv-float8_e4m3fn-...`).

    python -m engine.worker.attention.flashinfer_aot --head-dims 64,128 --dtypes bfloat16

builds them into FlashInfer's JIT cache (FLASHINFER_WORKSPACE_BASE, one folder per
FLASHINFER_CUDA_ARCH_LIST: the same list must be set where they are used) and prints one
JSON line per module with the seconds it took. nvcc is needed, a GPU is not when
FLASHINFER_CUDA_ARCH_LIST is set. `--list` prints the modules without building anything
(no flashinfer needed): the CPU dry run of scripts/gpu_check.sh checks the list that way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

PREFILL_BACKEND = "fa2"  # FA3 (Hopper) is ten heavy CUTLASS sm90 files: measured later
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {"auto": None, "float8_e4m3fn": torch.float8_e4m3fn}


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KernelModule:
    """One FlashInfer JIT module: `kind` names the generator, the rest its arguments."""

    kind: str  # "decode" | "prefill-fa2" | "prefill-fa2-paged"
    dtype: torch.dtype  # the queries' and outputs' (the model's)
    head_dim: int
    kv_dtype: torch.dtype | None = None  # the pages' (None: `dtype`; fp8 pages)

    @property
    def name(self) -> str:
        kv = "" if self.kv_dtype in (None, self.dtype) else f"-kv-{_short(self.kv_dtype)}"
        return f"{self.kind}-{_short(self.dtype)}{kv}-d{self.head_dim}"

    def args(self) -> tuple[Any, ...]:
        """(q, kv, o, idx dtypes, head_dim_qk, head_dim_vo, pos_encoding_mode=NONE,
        use_sliding_window, use_logits_soft_cap), as FlashInfer's wrappers pass them."""
        d = self.dtype
        kv = self.kv_dtype or d
        return (d, kv, d, torch.int32, self.head_dim, self.head_dim, 0, False, False)


def required_modules(
    head_dims: list[int],
    dtypes: list[torch.dtype],
    kv_dtypes: list[torch.dtype | None] | None = None,
) -> list[KernelModule]:
    """What the backend loads for these head dims, model dtypes and page dtypes (None: the
    model's, the default; see the module doc)."""
    kinds = ("decode", "prefill-fa2", "prefill-fa2-paged")
    return [
        KernelModule(k, d, h, kv)
        for kv in (kv_dtypes or [None])
        for d in dtypes
        for h in head_dims
        for k in kinds
    ]


def jit_spec(fi_modules: Any, module: KernelModule) -> Any:
    """FlashInfer's JitSpec for `module` (`fi_modules` is flashinfer.jit.attention.modules).

    The FA2 prefill wrapper loads a primary module (plan, ragged run) and, lazily, one for
    paged runs; a FlashInfer without that split builds one module for both."""
    args = module.args()
    if module.kind == "decode":
        return fi_modules.gen_batch_decode_module(*args)
    fa2 = (PREFILL_BACKEND, *args, False)  # + use_fp16_qk_reduction
    split = {
        "prefill-fa2": "_gen_batch_prefill_primary_module",
        "prefill-fa2-paged": "_gen_batch_prefill_independent_paged_module",
    }[module.kind]
    gen: Callable | None = getattr(fi_modules, split, None)
    if gen is not None:
        return gen(*fa2)
    return fi_modules.gen_batch_prefill_module(*fa2) if module.kind == "prefill-fa2" else None


def build_all(modules: list[KernelModule], fi_modules: Any) -> list[dict]:
    """Builds each module in turn (nvcc uses MAX_JOBS jobs); seconds per module."""
    out = []
    for m in modules:
        spec = jit_spec(fi_modules, m)
        if spec is None:
            continue
        t0 = time.perf_counter()
        spec.build()
        out.append({"module": m.name, "uri": spec.name, "seconds": time.perf_counter() - t0})
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--kv-dtypes", default="auto", help="auto (the model's) and/or float8_e4m3fn")
    ap.add_argument("--list", action="store_true", help="print the modules, build nothing")
    args = ap.parse_args(argv)
    modules = required_modules(
        [int(h) for h in args.head_dims.split(",")],
        [_DTYPES[d] for d in args.dtypes.split(",")],
        [_KV_DTYPES[d] for d in args.kv_dtypes.split(",")],
    )
    if args.list:
        print("\n".join(m.name for m in modules))
        return 0
    from flashinfer.jit.attention import modules as fi_modules

    build_all(modules, fi_modules)
    return 0


if __name__ == "__main__":
    sys.exit(main())
