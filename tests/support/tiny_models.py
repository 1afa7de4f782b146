"""Tiny random checkpoints and an offline tokenizer, built locally for tests.

Nothing here touches the network: the tokenizer is trained on a built-in corpus and the
models are random transformers models saved with `save_pretrained`, so every test can load a
real HF-format directory (config.json, generation_config.json, safetensors, tokenizer files)
in well under two seconds. `hf_greedy` is the transformers reference the engine is checked
against, token for token.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 512

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. What is the capital of France? The capital of France is Paris. Paris is a city
on the river Seine, and many people visit it every year to see the museums and the parks.
Once upon a time there was a little girl who lived in a village near the forest. She liked
to read books about stars, planets, oceans and mountains. Every morning she walked to the
school with her friends, and in the evening she helped her mother cook dinner.
Hello, how are you today? I am fine, thank you. Can you tell me a story about a dragon?
The dragon slept in a cave under the hill. It was green and gold, and it loved to count
its treasure: one, two, three, four, five, six, seven, eight, nine, ten coins of silver.
Computers process numbers and words. A language model predicts the next token of a text
given the tokens before it. The weather is nice and the sun is shining over the garden.
Water boils at one hundred degrees. The earth goes around the sun once every year.
"""


def _train_tokenizer() -> Any:
    """Byte-level BPE trained on the built-in corpus; deterministic for a fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    return tok


@functools.cache
def _tokenizer_json() -> str:
    return _train_tokenizer().to_str()


def make_tokenizer(out_dir: str | Path) -> Any:
    """Save a ChatML tokenizer (tokenizer.json, tokenizer_config.json) into `out_dir`.

    Returns the `PreTrainedTokenizerFast`. `<|endoftext|>` is eos and pad.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHATML_TEMPLATE,
        model_max_length=512,
    )
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


_ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

_ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "factor": 2.0},
}


def tiny_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    """A transformers config for a 2-layer, 64-wide model of `arch`."""
    import transformers

    if arch not in _ARCH_CLASSES:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(_ARCH_CLASSES)}")
    config_cls = getattr(transformers, _ARCH_CLASSES[arch][0])
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
        initializer_range=0.02,
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def _randomize_(model: torch.nn.Module, std: float) -> None:
    """Re-initialise so logits are spread out and norms/biases are not trivially 1/0.

    Default HF init (std 0.02, unit norms, zero biases) gives near-uniform logits and would
    not catch a norm weight or bias that failed to load.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)


def make_tiny_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    sliding_window: int | None = None,
    rope_scaling: str | dict[str, Any] | None = None,
    max_shard_size: str | None = None,
    seed: int = 0,
    weight_std: float = 0.15,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Build and save a tiny random `arch` model plus the test tokenizer; returns `out_dir`.

    - `sliding_window`: for mistral, the window; for qwen2/qwen3 it also turns on
      `use_sliding_window` with `max_window_layers=1`, so layer 0 is full and layer 1 slides.
    - `rope_scaling`: "llama3", "linear" or a full dict (rope_type, factor, ...).
    - `max_shard_size`: e.g. "60KB" to get several shards and model.safetensors.index.json.
    - `config_overrides`: any other config field (hidden_size, num_hidden_layers, ...;
      `vocab_size` at least the tokenizer's, for a model with padded embeddings).
    """
    import transformers
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    overrides: dict[str, Any] = dict(
        tie_word_embeddings=tie_word_embeddings, eos_token_id=eos_id, pad_token_id=eos_id
    )
    if sliding_window is not None:
        overrides["sliding_window"] = sliding_window
        if arch in ("qwen2", "qwen3"):
            overrides.update(use_sliding_window=True, max_window_layers=1)
    elif arch in ("mistral", "qwen2", "qwen3"):
        overrides["sliding_window"] = None
    if rope_scaling is not None:
        variant = _ROPE_VARIANTS[rope_scaling] if isinstance(rope_scaling, str) else rope_scaling
        overrides["rope_scaling"] = dict(variant)
    overrides.update(config_overrides)
    vocab_size = overrides.pop("vocab_size", len(tokenizer))  # wider: padded embeddings
    config = tiny_config(arch, vocab_size=vocab_size, **overrides)

    torch.manual_seed(seed)
    model_cls = getattr(transformers, _ARCH_CLASSES[arch][1])
    model = model_cls(config)
    _randomize_(model, weight_std)
    if tie_word_embeddings:
        model.tie_weights()
    model = model.to(dtype).eval()
    model.config.dtype = dtype
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **save_kwargs)
    GenerationConfig(
        eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None, do_sample=False
    ).save_pretrained(str(out))
    return out


@functools.lru_cache(maxsize=16)
def _hf_model(model_dir: str, dtype: torch.dtype = torch.float32) -> Any:
    """The checkpoint in transformers, eager attention, weights cast to `dtype` (RNE)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.to(dtype).eval()


def _eos_ids(model_dir: Path) -> set[int]:
    gen = model_dir / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


@torch.no_grad()
def hf_greedy(
    model_dir: str | Path,
    prompt_token_ids_list: list[list[int]],
    max_new_tokens: int,
    ignore_eos: bool = False,
    dtype: torch.dtype = torch.float32,
) -> list[list[int]]:
    """Transformers' greedy continuation of each prompt (eager attention, no padding), with
    the weights and activations in `dtype` (fp32 by default).

    One prompt at a time with the HF KV cache. Output lists hold only new tokens; generation
    stops after an eos token (which is included) unless `ignore_eos`.
    """
    model_dir = Path(model_dir)
    model = _hf_model(str(model_dir.resolve()), dtype)
    eos = set() if ignore_eos else _eos_ids(model_dir)
    return model_greedy(model, prompt_token_ids_list, max_new_tokens, eos)


@torch.no_grad()
def model_greedy(
    model: Any, prompt_token_ids_list: list[list[int]], max_new_tokens: int, eos: set[int]
) -> list[list[int]]:
    """Greedy continuation of each prompt by a transformers (or PEFT) model, one prompt at
    a time with its KV cache; stops after a token in `eos` (included)."""
    results = []
    for prompt in prompt_token_ids_list:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([prompt], dtype=torch.long), cache=cache, use_cache=True)
        new: list[int] = []
        while True:
            nxt = int(out.logits[0, -1].argmax())
            new.append(nxt)
            if len(new) >= max_new_tokens or nxt in eos:
                break
            out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
        results.append(new)
    return results


def _llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order (interleaved rope halves); transformers undoes it on load."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def make_tiny_gguf(
    hf_dir: str | Path, out_path: str | Path, quantize_q8: bool = False, qtype: str | None = None
) -> Path:
    """Write a llama-architecture GGUF of a tiny Llama checkpoint made by make_tiny_checkpoint.

    Tensors are F32 (exact round trip) or, with `quantize_q8`, the 2-D weights are Q8_0; with
    `qtype` (a `gguf.GGMLQuantizationType` name the gguf package quantizes: Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0) the 2-D weights are that type, quantized by gguf's own `quants.quantize`.
    The tokenizer (gpt2-style byte-level BPE) and chat template go into the metadata the way
    llama.cpp's converter writes them.
    """
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    if cfg["model_type"] != "llama":
        raise ValueError("make_tiny_gguf writes llama checkpoints only")
    tok = json.loads(_tokenizer_json())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    special = set(SPECIAL_TOKENS)
    eos_id = vocab[EOS_TOKEN]

    w = gguf.GGUFWriter(str(out_path), "llama")
    w.add_name("tiny llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_token_merges(merges)
    w.add_eos_token_id(eos_id)
    w.add_pad_token_id(eos_id)
    w.add_chat_template(CHATML_TEMPLATE)

    sd = load_file(str(hf_dir / "model.safetensors"))
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if "lm_head.weight" in sd:
        names["lm_head.weight"] = "output.weight"
    per_layer = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf_name, gg_name in names.items():
        t = sd[hf_name].float()
        if gg_name.endswith("attn_q.weight"):
            t = _llamacpp_permute(t, n_head)
        elif gg_name.endswith("attn_k.weight"):
            t = _llamacpp_permute(t, n_kv)
        arr = t.numpy().astype(np.float32)
        kind = qtype or ("Q8_0" if quantize_q8 else None)
        if kind and arr.ndim == 2:
            qt = gguf.GGMLQuantizationType[kind]
            q = gguf.quants.quantize(arr, qt)
            w.add_tensor(gg_name, q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(gg_name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
