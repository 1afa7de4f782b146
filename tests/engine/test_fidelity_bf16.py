"""Engine in bf16 vs transformers in bf16 on the same weights, on every fidelity-test arch.

bf16 cannot be compared token for token: the two sides round differently (fused QKV and
gate/up GEMMs, paged attention, other GEMM blocking), so near-ties in the argmax flip. What
is pinned instead, for NUM_PROMPTS prompts of 3 to 40 tokens and NEW greedy tokens each
(`measure`; transformers runs eager attention with weights cast to bf16, RNE, as ours are):

  prefix agreement  free running: per prompt, the length of the equal prefix of our NEW
                    tokens and transformers' over NEW (tokens after the first difference
                    are not counted: their contexts differ), averaged over prompts.
  top-1 agreement   teacher forced: over every position of transformers' continuations,
                    the fraction where transformers' token is also our argmax (rank 1).
  prefill lp        teacher forced: both score the same sequences, prompt + transformers'
                    continuation, ours through `prompt_logprobs` (the prefill path);
                    |ours - theirs| of each continuation token's logprob, max and mean.
  decode lp         teacher forced the other way: ours from `logprobs=0` while generating
                    (the decode path), theirs from scoring prompt + our continuation in one
                    forward; |ours - theirs| of each generated token's logprob, max and mean.

Both sides take log_softmax in fp32 of the bf16 logits, as our sampler does. The same code
on our fp32 engine vs transformers fp32 gives 1, 1, 0, 0 (a test below), so what remains
in bf16 is rounding, not the metric.

Measured on the plain torch path (cpu_kernels false), Xeon with AVX512-BF16 and no AMX,
prompts of seed 11:

    arch            prefix  top-1   prefill lp max / mean   decode lp max / mean
    llama           0.617   0.973   0.083 / 0.0148          0.083 / 0.0143
    mistral (sw 8)  0.461   0.977   0.058 / 0.0130          0.058 / 0.0138
    qwen2           0.645   0.977   0.061 / 0.0134          0.061 / 0.0151
    qwen3           0.793   0.992   0.089 / 0.0149          0.089 / 0.0152

With the bf16 CPU kernels and packed bf16 linears (cpu_kernels true, the default), same
machine and prompts: prefill lp is unchanged on every arch (the fused ops round where
transformers' bf16 ops round and are bit-equal to them, tests/worker/test_fused_ops.py);
decode goes through the C paged attention (fp32 inside, one rounding of its output):

    llama           0.617   0.973   0.083 / 0.0148          0.100 / 0.0153
    mistral (sw 8)  0.660   0.977   0.058 / 0.0130          0.059 / 0.0131
    qwen2           0.535   0.977   0.061 / 0.0134          0.066 / 0.0150
    qwen3           0.887   0.992   0.089 / 0.0149          0.074 / 0.0145

Other prompt seeds (12, 13) moved prefix agreement between 0.65 and 0.81 and the rest
little. Our *fp32* engine against transformers bf16 (an implementation more exact than
transformers' bf16, e.g. kernels keeping the residual in fp32) measured prefix 0.43-0.91,
top-1 >= 0.949, max <= 0.17, mean <= 0.0215. The tolerances admit that too, with margin,
so the bf16 kernels are not failed for being more precise than the reference:

    PREFIX_MIN 0.25   TOP1_MIN 0.93   LP_MAX 0.25   LP_MEAN 0.03

What they catch (the perturbation test): one row of one layer's o_proj off by 1.5x gives
top-1 0.80-0.87, max 0.42-0.80, mean 0.075-0.099, each beyond its tolerance on every arch;
negating that row gives prefix 0.04, top-1 0.5, max ~3. 1.2x is at the edge (mean
0.032-0.042). Bugs below bf16's own noise are invisible here by construction: RMSNorm
statistics in bf16 instead of fp32 measured like our fp32 engine (mean ~0.022); the fp32
fidelity tests pin the structure exactly.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.support.tiny_models import _hf_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
NEW = 32
NUM_PROMPTS = 8
BF16 = torch.bfloat16
# Tolerances: see the module docstring for what was measured and why these values.
PREFIX_MIN = 0.25
TOP1_MIN = 0.93
LP_MAX = 0.25
LP_MEAN = 0.03


def _prompts(seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(3, 40))] for _ in range(NUM_PROMPTS)]


@dataclass(frozen=True)
class Fidelity:
    prefix_agreement: float  # free running: mean over prompts of equal prefix / NEW
    top1_agreement: float  # teacher forced: transformers' token is our argmax, fraction
    prefill_max: float  # teacher forced |logprob diff| of transformers' continuation tokens
    prefill_mean: float
    decode_max: float  # |logprob diff| of our generated tokens, transformers scoring them
    decode_mean: float

    def __str__(self) -> str:
        return (
            f"prefix {self.prefix_agreement:.3f}  top1 {self.top1_agreement:.3f}  "
            f"prefill lp {self.prefill_max:.4f} / {self.prefill_mean:.4f}  "
            f"decode lp {self.decode_max:.4f} / {self.decode_mean:.4f}"
        )


Seqs = tuple[tuple[int, ...], ...]  # hashable: the transformers side is cached per input


@functools.cache
@torch.no_grad()
def hf_logprobs(model_dir: Path, dtype: torch.dtype, seqs: Seqs) -> torch.Tensor:
    """[B, max len, vocab] fp32 log_softmax of transformers' logits (in `dtype`) for `seqs`,
    one right-padded batch: causal attention never lets a position see the padding after it."""
    model = _hf_model(str(model_dir.resolve()), dtype)
    width = max(len(s) for s in seqs)
    logits = model(torch.tensor([[*s] + [0] * (width - len(s)) for s in seqs])).logits
    return torch.log_softmax(logits.float(), dim=-1)


@functools.cache
@torch.no_grad()
def hf_greedy_batch(model_dir: Path, dtype: torch.dtype, prompts: Seqs, new: int) -> Seqs:
    """Transformers' greedy continuations (`new` tokens each, EOS ignored) of all prompts in
    one left-padded batch: `new` forwards in all instead of `new` per prompt."""
    from transformers import DynamicCache

    model = _hf_model(str(model_dir.resolve()), dtype)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + [*p] for p in prompts])  # [B, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each prompt starts at position 0
    cache = DynamicCache(config=model.config)
    chosen = []
    for _ in range(new):
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        )
        ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        chosen.append(ids)
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
        positions = positions[:, -1:] + 1
    return tuple(map(tuple, torch.cat(chosen, dim=1).tolist()))


def _key(seqs: Iterable[list[int]]) -> Seqs:
    return tuple(tuple(s) for s in seqs)


def _equal_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def measure(llm: LLM, model_dir: Path, dtype: torch.dtype, prompts: list[list[int]]) -> Fidelity:
    """The metrics of the module docstring: our `llm` against transformers in `dtype`."""
    ref = [list(r) for r in hf_greedy_batch(model_dir, dtype, _key(prompts), NEW)]
    gen = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    ours = [out.outputs[0] for out in gen]
    scored = llm.generate(
        [{"prompt_token_ids": p + r} for p, r in zip(prompts, ref, strict=True)],
        SamplingParams(max_tokens=0, prompt_logprobs=0),
        use_tqdm=False,
    )
    hf_on_ref = hf_logprobs(
        model_dir, dtype, _key(p + r for p, r in zip(prompts, ref, strict=True))
    )
    hf_on_ours = hf_logprobs(
        model_dir, dtype, _key(p + o.token_ids for p, o in zip(prompts, ours, strict=True))
    )
    prefix, top1, prefill, decode = [], [], [], []
    for b, (prompt, theirs, mine, score) in enumerate(zip(prompts, ref, ours, scored, strict=True)):
        prefix.append(_equal_prefix(mine.token_ids, theirs) / NEW)
        for i, tok in enumerate(theirs):  # position pos predicts token pos + 1
            pos = len(prompt) + i
            got = score.prompt_logprobs[pos]
            assert got.token_id == tok
            top1.append(got.rank == 1)
            prefill.append(abs(got.logprob - hf_on_ref[b, pos - 1, tok].item()))
        for i, lp in enumerate(mine.logprobs):
            assert lp.token_id == mine.token_ids[i]
            decode.append(abs(lp.logprob - hf_on_ours[b, len(prompt) - 1 + i, lp.token_id].item()))
    return Fidelity(
        prefix_agreement=sum(prefix) / len(prefix),
        top1_agreement=sum(top1) / len(top1),
        prefill_max=max(prefill),
        prefill_mean=sum(prefill) / len(prefill),
        decode_max=max(decode),
        decode_mean=sum(decode) / len(decode),
    )


def _llm(model_dir: Path, dtype: str, cpu_kernels: bool = True) -> LLM:
    return LLM(
        str(model_dir), dtype=dtype, num_kv_blocks=256, block_size=4, cpu_kernels=cpu_kernels
    )


def _checkpoint(tiny_checkpoint, arch: str) -> Path:
    # mistral with a window shorter than the sequences: the sliding-window path in bf16.
    return tiny_checkpoint(arch, sliding_window=8) if arch == "mistral" else tiny_checkpoint(arch)


def violations(f: Fidelity) -> list[str]:
    """The tolerances `f` breaks, by name (empty: within all of them)."""
    checks = {
        "prefix_agreement": f.prefix_agreement >= PREFIX_MIN,
        "top1_agreement": f.top1_agreement >= TOP1_MIN,
        "prefill_max": f.prefill_max <= LP_MAX,
        "prefill_mean": f.prefill_mean <= LP_MEAN,
        "decode_max": f.decode_max <= LP_MAX,
        "decode_mean": f.decode_mean <= LP_MEAN,
    }
    return [name for name, ok in checks.items() if not ok]


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["plain", "kernels"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_engine_tracks_transformers_bf16(arch, cpu_kernels, tiny_checkpoint):
    model_dir = _checkpoint(tiny_checkpoint, arch)
    fidelity = measure(_llm(model_dir, "bfloat16", cpu_kernels), model_dir, BF16, _prompts())
    assert violations(fidelity) == [], str(fidelity)


def test_same_metric_on_fp32_is_exact(tiny_checkpoint):
    """Our fp32 engine vs transformers fp32: the metric code itself adds nothing."""
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    f = measure(_llm(model_dir, "float32"), model_dir, torch.float32, _prompts())
    assert (f.prefix_agreement, f.top1_agreement) == (1.0, 1.0)
    assert max(f.prefill_max, f.decode_max) < 1e-4, str(f)


def test_tolerances_admit_fp32_numerics(tiny_checkpoint):
    """An engine more exact than transformers' bf16 (here: ours in fp32) passes them too."""
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    fidelity = measure(_llm(model_dir, "float32", cpu_kernels=False), model_dir, BF16, _prompts())
    assert violations(fidelity) == [], str(fidelity)


def test_tolerances_catch_one_wrong_weight_row(tiny_checkpoint):
    """Row 7 of layer 0's o_proj 1.5x too large after load (the plain path, so no packed copy
    hides the change): every logprob and top-1 tolerance is broken."""
    model_dir = _checkpoint(tiny_checkpoint, "llama")
    llm = _llm(model_dir, "bfloat16", cpu_kernels=False)
    with torch.no_grad():
        llm.engine.runner.model.model.layers[0].self_attn.o_proj.weight[7].mul_(1.5)
    fidelity = measure(llm, model_dir, BF16, _prompts())
    broken = set(violations(fidelity))
    assert broken >= {"top1_agreement", "prefill_max", "prefill_mean", "decode_max", "decode_mean"}
