"""fp8 KV pages (`cache.kv_dtype: fp8_e4m3`) against pages in the model's dtype: the KV part
of the `fp8` phase of scripts/gpu_check.sh (bench/gpu_phases.py calls `fp8_kv_check`).

On the device, on the phase's random Llama-3-8B-shaped bf16 model, with FlashInfer:

  jit       the modules fp8 pages need (bf16 queries, e4m3 pages, head dim 128: decode, FA2
            prefill and its paged part; the same sources as bf16, instantiated with an
            e4m3 KV type), built and timed one by one; then the backend is chosen and
            probed over fp8 pages
  fidelity  teacher-forced: 8 prompts of 64 tokens prefilled in two chunks, then 32 greedy
            decode steps on bf16 pages; the fp8 run is fed the same tokens. Per position:
            |delta log p| of the reference's token, the largest |delta log p| over the
            vocabulary, argmax agreement, and where the argmax differs the reference's top-2
            margin there. Also what the bf16 pages held: the largest |K| / |V| and the share
            of elements under 2**-6 (e4m3's subnormals) and over 448 (saturated in fp8)
  decode    tok/s at batch 1 and 64, context 512, eager and graphs, bf16 pages vs fp8
            pages, one after the other on the same model and backend (bench/gpu_decode.py)

Kernel correctness over fp8 pages is the start-up probe's verdict (it runs in the backend
choice here: outputs within 0.05 + 0.05|ref| of the torch backend on the pages' values,
pages byte-equal) and test_gpu.py's `fp8_pages` tests (the `fp8kv` phase). The measurement
here grades what e4m3 rounding does to a whole model; `check_fidelity` fails it only when
the mean |delta log p| of the reference token exceeds `MAX_MEAN_DLOGP`, which a cast other
than e4m3 or a kernel reading the bytes as another type does by whole nats. The dry run
(CPU): TINY dims, bf16, the stand-in flashinfer module (tests/support/fake_flashinfer.py),
whose attention reads the dequantized pages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

BLOCK = 16
PROMPTS, PROMPT_LEN, CHUNK, STEPS = 8, 64, 32, 32
# The verdict catches a broken path, it does not grade the rounding (module doc). Random
# N(0, 0.02) weights amplify any perturbation layer after layer, and more so the wider the
# model; measured on the CPU with the stand-in (bf16, Llama-3-8B's heads and widths, fewer
# layers), mean |delta log p| of the reference token over 272 positions: e4m3 pages 0.12
# (4 layers) and 0.16 (8 layers); e5m2 bytes written into them (a wrong cast) 2.4 (4 layers).
MAX_MEAN_DLOGP = 1.0
E4M3_TINY = 2.0**-6


def fp8_kv_modules(head_dim: int = 128) -> list:
    """The modules for bf16 queries over e4m3 pages (flashinfer_aot's names): the FA2
    prefill pair (Llama-3-8B's group of 4 decodes on it too) and the CUDA-core decode
    (test_gpu.py's tiny model, a group of 2)."""
    from engine.worker.attention import flashinfer_aot as aot

    return aot.required_modules([head_dim], [torch.bfloat16], kv_dtypes=[torch.float8_e4m3fn])


def page_stats(caches: list[torch.Tensor], used_blocks: list[int]) -> dict[str, Any]:
    """Largest |K| and |V| in the blocks used, and the shares e4m3 cannot hold as well."""
    idx = torch.tensor(sorted(used_blocks), device=caches[0].device)
    k = torch.cat([c[idx, 0].float().flatten() for c in caches]).abs()
    v = torch.cat([c[idx, 1].float().flatten() for c in caches]).abs()
    both = torch.cat([k, v])
    return dict(
        max_abs_k=round(float(k.max()), 3), max_abs_v=round(float(v.max()), 3),
        share_below_2e_6=round(float((both < E4M3_TINY).float().mean()), 4),
        share_above_448=float((both > 448.0).float().mean()),
    )  # fmt: skip


@torch.inference_mode()
def teacher_forced(model, backend, dev: torch.device, vocab: int) -> dict[str, Any]:
    """bf16 pages greedy, fp8 pages fed the same tokens; per-position log-prob differences."""
    from tests.support.paged_harness import PagedRun

    dtype = next(model.parameters()).dtype
    blocks = PROMPTS * -(-(PROMPT_LEN + STEPS) // BLOCK) + 1
    runs = {}  # the same seed, so the same block tables
    for kv in (dtype, torch.float8_e4m3fn):
        runs[kv] = PagedRun(model, backend, blocks, BLOCK, dtype=kv, device=dev)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (PROMPTS, PROMPT_LEN), generator=gen).tolist()
    dlogp, dvocab, margins, agree = [], [], [], 0

    def step(chunks: dict[int, list[int]]) -> dict[int, int]:
        """Both runs fed `chunks`; the reference's greedy token after each request's last."""
        nonlocal agree
        ref, got = (run.step(chunks) for run in runs.values())
        nxt = {}
        for r in chunks:
            a = torch.log_softmax(ref[r][-1:].float(), -1)[0]
            b = torch.log_softmax(got[r][-1:].float(), -1)[0]
            top2 = a.topk(2)
            tok = int(top2.indices[0])
            dlogp.append(float((a[tok] - b[tok]).abs()))
            dvocab.append(float((a - b).abs().max()))
            if int(b.argmax()) == tok:
                agree += 1
            else:
                margins.append(round(float(top2.values[0] - top2.values[1]), 4))
            nxt[r] = tok
        return nxt

    step({r: p[:CHUNK] for r, p in enumerate(prompts)})
    toks = step({r: p[CHUNK:] for r, p in enumerate(prompts)})
    for _ in range(STEPS):
        toks = step({r: [t] for r, t in toks.items()})
    ref_run = runs[dtype]
    used = [b for table in ref_run.tables.values() for b in table]
    n = len(dlogp)
    return dict(
        positions=n, argmax_agreement=round(agree / n, 4),
        max_dlogp_token=round(max(dlogp), 4), mean_dlogp_token=round(sum(dlogp) / n, 5),
        max_dlogp_vocab=round(max(dvocab), 4),
        disagreements=len(margins), largest_margins_flipped=sorted(margins)[-8:],
        model_dtype_pages=page_stats(ref_run.kv_caches, used),
    )  # fmt: skip


def check_fidelity(tf: dict[str, Any]) -> None:
    """Raises when fp8 pages moved the model as only a broken path does (module doc)."""
    if tf["mean_dlogp_token"] > MAX_MEAN_DLOGP:
        raise RuntimeError(
            f"fp8 pages moved the reference token's log-prob by {tf['mean_dlogp_token']} on "
            f"average (limit {MAX_MEAN_DLOGP}): more than e4m3 rounding does; {tf}"
        )


def fp8_kv_check(
    model, dev: torch.device, dry: bool, save: Callable[[], None], res: dict[str, Any]
) -> None:
    """Fills `res` (the phase's "kv_pages" entry) part by part, saving as it goes; raises
    on an error, or at the end when `check_fidelity` fails."""
    from bench.gpu_decode import decode_modes
    from engine.worker.attention import flashinfer_aot as aot
    from engine.worker.attention.selection import select_attention_backend
    from engine.worker.kv_sizing import KVGeometry

    dtype = next(model.parameters()).dtype
    geo = {str(kv).removeprefix("torch."): KVGeometry.of(model, BLOCK, kv).bytes_per_block
           for kv in (dtype, torch.float8_e4m3fn)}  # fmt: skip
    res["bytes_per_block"] = geo
    mods = fp8_kv_modules(model.head_dim)
    res["modules"] = [m.name for m in mods]
    # What this model runs first (a GQA group of 4 or more decodes on the prefill kernels);
    # the CUDA-core decode module last, for the fp8kv phase's group-2 model.
    tensor_cores = model.attention_specs[0].num_heads // model.num_kv_heads >= 4
    first = [m for m in mods if m.kind != "decode" or not tensor_cores]
    later = [m for m in mods if m not in first]

    def build(part: list) -> None:
        if dry or not part:
            return
        from flashinfer.jit.attention import modules as fi_modules

        t0 = time.perf_counter()
        res.setdefault("jit", []).extend(aot.build_all(part, fi_modules))
        res["jit_seconds"] = round(res.get("jit_seconds", 0) + time.perf_counter() - t0, 1)
        save()

    build(first)
    fake = None
    if dry:  # the stand-in module: the same backend code, attention in plain torch on the CPU
        from tests.support.fake_flashinfer import FakeFlashInfer as fake
    t0 = time.perf_counter()
    backend = select_attention_backend(
        dev, dtype, specs=model.attention_specs, block_size=BLOCK, kv_dtype=torch.float8_e4m3fn,
        setting="flashinfer", flashinfer_module=fake,
    ).backend  # fmt: skip
    res["backend"] = backend.name
    res["probe_seconds"] = round(time.perf_counter() - t0, 2)
    save()
    tf = teacher_forced(model, backend, dev, model.vocab_size)
    res["teacher_forced"] = tf
    res["planned_kv_dtypes"] = sorted(
        {str(k.kv_dtype).removeprefix("torch.") for k in [*backend._decode, *backend._prefill]}
    )
    save()
    batches, context, steps = ([1, 4], 40, 3) if dry else ([1, 64], 512, 32)
    for kv, key in ((dtype, "bf16_pages"), (torch.float8_e4m3fn, "fp8_pages")):
        decode_modes(model, backend, dev, batches, context, steps, res, save, kv, key)
    res["fp8_over_bf16"] = {
        f"{mode}_b{b}": round(
            res[f"fp8_pages_{mode}_b{b}"]["tokens_per_s"]
            / res[f"bf16_pages_{mode}_b{b}"]["tokens_per_s"], 3,
        )
        for mode in ("eager", "graphs") for b in batches
        if f"fp8_pages_{mode}_b{b}" in res and f"bf16_pages_{mode}_b{b}" in res
    }  # fmt: skip
    save()
    build(later)
    check_fidelity(tf)
