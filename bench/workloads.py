"""Benchmark workloads (random token-id prompts) and the checkpoints they run on.

Workloads (issue 8), all deterministic for a seed, prompts as token ids so every engine sees
exactly the same tokens:

- `w64`: 64 requests, prompt lengths uniform in [32, 256], 128 output tokens each, ignore
  EOS, greedy, all submitted at once.
- `w64-prefill`: W64's prompts with one output token each (prefill speed alone).
- `w256-long`: 256 requests, prompts uniform in [100, 1024], outputs uniform in [100, 1024]
  (nano-vllm's benchmark). `scale` multiplies the request count and `len_scale` the upper
  ends of both length ranges (lower end stays 100) so the workload fits a small machine.
- `shared-prefix`: one 1,024-token system prompt shared by 32 requests, each followed by its
  own 16-64 token user part; 16 output tokens (the point is TTFT).

Models (built once into ~/.cache/appliance-bench/models, or APPLIANCE_BENCH_CACHE):

- `tiny`: tests/support/tiny_models.py's 2-layer, 64-wide Llama with its 512-token tokenizer; only
  for `--quick` smoke runs.
- `llama50m`: a ~50M-param Llama with random weights: hidden 512, 8 layers, intermediate
  1536, 8 heads / 4 KV heads (head_dim 64), tied embeddings, SmolLM2's 49,152-token
  tokenizer (copied from the default model), max 2,048 positions, fp32. It is built with
  transformers directly rather than `make_tiny_checkpoint`, which derives vocab_size from
  its 512-token test tokenizer and cannot take a larger one; a real tokenizer that covers
  the vocabulary keeps detokenization honest in every engine.
- `micro`: the same recipe at toy size (hidden 128, 2 layers, 4 heads / 2 KV heads,
  head_dim 32, SmolLM2's tokenizer; 6.7M parameters, nearly all embeddings): for `--quick` runs that include vLLM, whose CPU attention needs a
  head size of 32 or more (the `tiny` model's is 16).
- `smollm2`: the default model (SmolLM2-135M-Instruct), its GGUF dequantized to a float32
  safetensors checkpoint (bench/float_checkpoint.py; the directory
  `engine.worker.models.loader.resolve_model_path(None)` converts holds no weights).

    python bench/workloads.py --build llama50m     # build/print a model dir
    python bench/workloads.py --show w64           # print a workload summary
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import CACHE_DIR  # noqa: E402

MODELS_DIR = CACHE_DIR / "models"
# Lowest token id used in random prompts: keeps clear of special/control tokens at the start
# of the vocabulary (SmolLM2's first 17 ids are special), which some engines treat specially.
MIN_TOKEN_ID = 100


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def max_seq_len(self) -> int:
        return max(len(p) + m for p, m in zip(self.prompts, self.max_tokens, strict=True))

    def summary(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {
            "workload": self.name,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prompt_len_min": min(lens),
            "prompt_len_max": max(lens),
            "max_tokens_min": min(self.max_tokens),
            "max_tokens_max": max(self.max_tokens),
            **self.meta,
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _rngs(seed: int) -> tuple[random.Random, random.Random]:
    """Separate streams for lengths and token ids, so lengths do not depend on the vocab."""
    return random.Random(seed), random.Random(seed + 7_919_000)


def _rand_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo = MIN_TOKEN_ID if vocab > 4 * MIN_TOKEN_ID else 1
    return [rng.randrange(lo, vocab) for _ in range(n)]


def w64(
    vocab: int, seed: int = 0, num_requests: int = 64, min_len: int = 32, max_len: int = 256,
    output_len: int = 128,
) -> Workload:  # fmt: skip
    rng, ids = _rngs(seed)
    prompts = [_rand_ids(ids, rng.randint(min_len, max_len), vocab) for _ in range(num_requests)]
    name = "w64" if (num_requests, min_len, max_len, output_len) == (64, 32, 256, 128) else (
        f"w64-n{num_requests}-p{min_len}_{max_len}-o{output_len}"
    )  # fmt: skip
    return Workload(name, prompts, [output_len] * num_requests, {"seed": seed})


def w256_long(vocab: int, seed: int = 0, scale: float = 1.0, len_scale: float = 1.0) -> Workload:
    rng, ids = _rngs(seed)
    n = max(1, round(256 * scale))
    hi = max(100, round(1024 * len_scale))
    prompts, outs = [], []
    for _ in range(n):
        prompts.append(_rand_ids(ids, rng.randint(100, hi), vocab))
        outs.append(rng.randint(100, hi))
    name = "w256-long" if scale == 1.0 and len_scale == 1.0 else (
        f"w256-long(x{scale:g},len x{len_scale:g})"
    )  # fmt: skip
    return Workload(name, prompts, outs, {"seed": seed, "scale": scale, "len_scale": len_scale})


def shared_prefix(
    vocab: int, seed: int = 0, num_requests: int = 32, prefix_len: int = 1024,
    suffix_min: int = 16, suffix_max: int = 64, output_len: int = 16,
) -> Workload:  # fmt: skip
    rng, ids = _rngs(seed)
    system = _rand_ids(ids, prefix_len, vocab)
    prompts = [
        system + _rand_ids(ids, rng.randint(suffix_min, suffix_max), vocab)
        for _ in range(num_requests)
    ]
    return Workload(
        "shared-prefix", prompts, [output_len] * num_requests,
        {"seed": seed, "prefix_len": prefix_len},
    )  # fmt: skip


def make_workload(name: str, vocab: int, seed: int = 0, **kw: Any) -> Workload:
    if name == "w64":
        return w64(vocab, seed, **kw)
    if name == "w64-prefill":  # W64's prompts, one output token each: prefill alone
        return replace(w64(vocab, seed, output_len=1, **kw), name="w64-prefill")
    if name == "w256-long":
        return w256_long(vocab, seed, **kw)
    if name == "shared-prefix":
        return shared_prefix(vocab, seed, **kw)
    raise ValueError(
        f"unknown workload {name!r}; choose from w64, w64-prefill, w256-long, shared-prefix"
    )


# ---- models --------------------------------------------------------------------------------

LLAMA50M = dict(
    hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, vocab_size=49152,
    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
)  # fmt: skip
MICRO = dict(LLAMA50M, hidden_size=128, num_hidden_layers=2, intermediate_size=384,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip
RANDOM_LLAMAS = {"llama50m": LLAMA50M, "micro": MICRO}
MODEL_NAMES = ("tiny", "micro", "llama50m", "smollm2")


def smollm2_dir() -> Path:
    from engine.worker.models.loader import resolve_model_path

    return Path(resolve_model_path(None))


def _build_tiny(out: Path) -> None:
    from tests.support.tiny_models import make_tiny_checkpoint

    make_tiny_checkpoint(out, "llama")


def _build_random_llama(out: Path, shape: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    src = smollm2_dir()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    src_cfg = json.loads((src / "config.json").read_text())
    bos, eos = src_cfg.get("bos_token_id", 1), src_cfg.get("eos_token_id", 2)
    cfg = LlamaConfig(**shape, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.config.dtype = torch.float32
    model.save_pretrained(str(out))
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos).save_pretrained(str(out))


def ensure_model(name: str) -> Path:
    """The checkpoint dir for `name` (built on first use), or `name` itself if it is a path."""
    if name == "smollm2":  # the float32 checkpoint (the converted dir holds no weights)
        from bench.float_checkpoint import smollm2_float_dir

        return smollm2_float_dir()
    if name != "tiny" and name not in RANDOM_LLAMAS:
        p = Path(name)
        if p.exists():
            return p
        raise ValueError(f"unknown model {name!r}; choose from {MODEL_NAMES} or give a path")
    out = MODELS_DIR / name
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    tmp = MODELS_DIR / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    if name == "tiny":
        _build_tiny(tmp)
    else:
        _build_random_llama(tmp, RANDOM_LLAMAS[name])
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def model_info(path: Path) -> dict[str, Any]:
    """Shape facts from config.json plus the parameter count from the safetensors headers."""
    cfg = json.loads((path / "config.json").read_text())
    n = 0
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            hlen = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(hlen))
        for k, v in header.items():
            if k != "__metadata__":
                size = 1
                for d in v["shape"]:
                    size *= d
                n += size
    heads = cfg["num_attention_heads"]
    return {
        "params": n,
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "num_layers": cfg["num_hidden_layers"],
        "intermediate_size": cfg["intermediate_size"],
        "num_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build", choices=MODEL_NAMES, help="build (if needed) and print a model dir")
    ap.add_argument("--show", choices=("w64", "w256-long", "shared-prefix"))
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--scale", type=float, default=1.0, help="w256-long request-count scale")
    ap.add_argument("--len-scale", type=float, default=1.0, help="w256-long length scale")
    args = ap.parse_args()
    if args.build:
        p = ensure_model(args.build)
        print(p)
        print(json.dumps(model_info(p), indent=2))
    if args.show:
        kw = {"scale": args.scale, "len_scale": args.len_scale} if args.show == "w256-long" else {}
        print(json.dumps(make_workload(args.show, args.vocab, **kw).summary(), indent=2))
    if not (args.build or args.show):
        ap.print_help()


if __name__ == "__main__":
    main()
