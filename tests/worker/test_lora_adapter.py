"""Reading PEFT adapters: what PEFT writes is accepted with PEFT's scaling, and everything
the engine cannot run is refused with a message naming the problem."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import InvalidRequestError, LoRAError
from engine.lora_request import LoRARequest
from engine.worker.lora.layers import lora_shapes
from engine.worker.lora.peft_adapter import LoRAShapes, load_peft_adapter
from tests.support.tiny_lora import make_tiny_adapter

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def base_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def shapes(base_dir) -> LoRAShapes:
    from transformers import AutoConfig

    from engine.worker.models.loader import build_model

    model = build_model(AutoConfig.from_pretrained(base_dir), torch.float32, torch.device("cpu"))
    return lora_shapes(model)


@pytest.fixture(scope="module")
def adapter(base_dir, tmp_path_factory) -> Path:
    return make_tiny_adapter(base_dir, tmp_path_factory.mktemp("lora") / "all", r=4, alpha=8)


def _load(path, shapes, max_rank=16, name="x"):
    return load_peft_adapter(LoRARequest(name, 1, str(path)), shapes, max_rank, torch.float32)


def _copy(src: Path, dst: Path, config_changes=None) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config_changes)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_peft_adapter_is_read_with_scale_folded_into_b(adapter, shapes):
    w = _load(adapter, shapes)
    raw = load_file(str(adapter / "adapter_model.safetensors"))
    assert len(w.modules) == 2 * 7 and w.rank == 4
    a, b = w.modules[(1, "gate_proj")]
    torch.testing.assert_close(a, raw[f"{PREFIX}.1.mlp.gate_proj.lora_A.weight"])
    torch.testing.assert_close(b, raw[f"{PREFIX}.1.mlp.gate_proj.lora_B.weight"] * (8 / 4))
    assert len(w.key) == 32 and _load(adapter, shapes, name="y").key == w.key


def test_rslora_rank_and_alpha_patterns_follow_peft(base_dir, shapes, tmp_path):
    path = make_tiny_adapter(
        base_dir,
        tmp_path / "patterns",
        targets=["q_proj", "down_proj"],
        r=4,
        alpha=6,
        use_rslora=True,
        rank_pattern={"down_proj": 2},
        alpha_pattern={r"layers\.1\.self_attn\.q_proj": 3},
    )
    w = _load(path, shapes)
    raw = load_file(str(path / "adapter_model.safetensors"))
    expected = {
        (0, "q_proj", "self_attn"): 6 / math.sqrt(4),
        (1, "q_proj", "self_attn"): 3 / math.sqrt(4),
        (1, "down_proj", "mlp"): 6 / math.sqrt(2),
    }
    for (layer, proj, block), scale in expected.items():
        b = raw[f"{PREFIX}.{layer}.{block}.{proj}.lora_B.weight"]
        torch.testing.assert_close(w.modules[(layer, proj)][1], b * scale)
    assert w.modules[(0, "down_proj")][0].shape == (2, 128)


@pytest.mark.parametrize("targets", ["all-linear", r".*\.(q_proj|v_proj)"])
def test_regex_and_all_linear_targets_are_accepted(base_dir, shapes, tmp_path, targets):
    w = _load(make_tiny_adapter(base_dir, tmp_path / "t", targets=targets, r=2), shapes)
    assert {p for _, p in w.modules} == (
        {"q_proj", "v_proj"} if targets != "all-linear" else set(shapes.projections)
    )


def test_refusals_are_request_errors_naming_the_adapter(tmp_path, shapes):
    with pytest.raises(LoRAError) as e:
        _load(tmp_path / "nowhere", shapes, name="sql")
    assert isinstance(e.value, InvalidRequestError)
    assert str(e.value).startswith(f"LoRA adapter 'sql' ({tmp_path / 'nowhere'}): ")
    assert "does not exist" in str(e.value)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"target_modules": ["q_proj", "embed_tokens"]}, r"target_modules \['embed_tokens'\]"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias 'all'"),
        ({"lora_bias": True}, "lora_bias"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"r": 0}, "r must be a positive number"),
        ({"r": 8}, "has rank 4 but the config gives it r=8"),
    ],
)
def test_unsupported_configs_are_refused(adapter, shapes, tmp_path, change, message):
    with pytest.raises(LoRAError, match=message):
        _load(_copy(adapter, tmp_path / "bad", change), shapes)


def test_rank_above_the_limit_is_refused(adapter, shapes):
    with pytest.raises(LoRAError, match="has rank 4, above lora.max_lora_rank 2"):
        _load(adapter, shapes, max_rank=2)


def test_an_adapter_for_another_base_model_is_refused(tiny_checkpoint, shapes, tmp_path):
    wider = tiny_checkpoint("llama", hidden_size=96)
    path = make_tiny_adapter(wider, tmp_path / "wider", targets=["q_proj"], r=2)
    with pytest.raises(LoRAError, match=r"lora_A \(2, 96\) .* do not fit the base model's q_proj"):
        _load(path, shapes)
    deeper = tiny_checkpoint("llama", num_hidden_layers=3)
    path = make_tiny_adapter(deeper, tmp_path / "deeper", targets=["o_proj"], r=2)
    with pytest.raises(LoRAError, match="is for layer 2; the base model has 2"):
        _load(path, shapes)


def _rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(str(path / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}),
            "'base_model.model.lm_head.lora_A.weight' is not a LoRA weight of a supported module",
        ),
        (
            lambda t: t.update(
                {f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(64)}
            ),
            "DoRA magnitudes",
        ),
        (
            lambda t: t.pop(f"{PREFIX}.0.mlp.up_proj.lora_B.weight"),
            "model.layers.0.mlp.up_proj has no lora_B weight",
        ),
        (lambda t: t.clear(), "holds no LoRA weights"),
    ],
)
def test_unsupported_weights_are_refused(adapter, shapes, tmp_path, edit, message):
    path = _copy(adapter, tmp_path / "bad")
    _rewrite_weights(path, edit)
    with pytest.raises(LoRAError, match=message):
        _load(path, shapes)


def test_missing_and_unreadable_files_are_refused(adapter, shapes, tmp_path):
    no_weights = _copy(adapter, tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").rename(no_weights / "adapter_model.bin")
    with pytest.raises(LoRAError, match=r"adapter_model.safetensors is missing \(adapter_model"):
        _load(no_weights, shapes)
    no_config = _copy(adapter, tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(LoRAError, match="adapter_config.json is missing"):
        _load(no_config, shapes)
    bad_json = _copy(adapter, tmp_path / "bad_json")
    (bad_json / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="adapter_config.json is not valid JSON"):
        _load(bad_json, shapes)
    bad_weights = _copy(adapter, tmp_path / "bad_weights")
    (bad_weights / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(LoRAError, match="adapter_model.safetensors cannot be read"):
        _load(bad_weights, shapes)
