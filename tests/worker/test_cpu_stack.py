"""The one-call decoder stack (engine/worker/models/cpu_stack.py) computes bitwise what the
op-by-op CPU forward computes: logits and KV caches equal under decode steps of several
requests, short verify-like chunks and a sliding window, in fp32 and bf16, on q4 column
groups and q8 blocks, and on bf16 weights in AMX tiles where the CPU has them; steps outside it (many rows, a long prefill chunk) and models outside
it (LoRA-wrapped, int8 activations) take the op-by-op path."""

from __future__ import annotations

import pytest
import torch

from engine.config import LoRAConfig, ModelConfig
from engine.worker.attention.torch_paged import TorchPagedBackend
from engine.worker.kernels import amx_linear
from engine.worker.kernels import quant as qkernels
from engine.worker.kernels import stack as kstack
from engine.worker.lora.model_lora import ModelLoRA
from engine.worker.models import cpu_stack
from engine.worker.models.loader import load_model
from tests.support.paged_harness import PagedRun
from tests.support.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="no C compiler")

CPU = torch.device("cpu")

# (request -> new token ids) per step: a 5-token prompt chunk (rows of the native kernel),
# a decode step of three requests, a 3+1+1 verify-like step, a 40-token prefill (op by op:
# more rows than the block kernels' side of the row rule), then decodes again.
STEPS = [
    {"a": [5, 77, 300, 12, 9], "b": [401, 250], "c": [3]},
    {"a": [64], "b": [128], "c": [17]},
    {"a": [211, 90, 45], "b": [6], "c": [333]},
    {"d": list(range(20, 60))},
    {"a": [2], "b": [120], "c": [77], "d": [7]},
    {"a": [8], "d": [9]},
]


def _load(path, quantization: str, dtype: str, **model_kw):
    loaded = load_model(
        ModelConfig(path=str(path), quantization=quantization, dtype=dtype, **model_kw), CPU
    )
    loaded.model.enable_cpu_kernels()
    return loaded


def _run(loaded, steps, stack_on: bool, monkeypatch) -> tuple[list, list, int]:
    model = loaded.model
    if not stack_on:
        model._cpu_stack, model._cpu_stack_checked = None, True
    calls = []
    real = kstack.run

    def counted(m, s, n):
        calls.append(int(s.T))
        return real(m, s, n)

    monkeypatch.setattr(kstack, "run", counted)
    run = PagedRun(model, TorchPagedBackend(), dtype=loaded.dtype, block_size=4)
    logits = [run.step(chunks) for chunks in steps]
    monkeypatch.setattr(kstack, "run", real)
    return logits, [c.clone() for c in run.kv_caches], calls


@pytest.mark.parametrize(
    ("arch", "quantization", "dtype", "window"),
    [
        ("llama", "int4", "float32", None),
        ("llama", "int4", "bfloat16", None),
        ("qwen2", "int8", "float32", None),  # q8 blocks and a q/k/v bias
        ("mistral", "int4", "bfloat16", 3),  # a sliding window
        *(
            pytest.param(
                arch,
                "none",
                "bfloat16",
                window,
                marks=pytest.mark.skipif(not amx_linear.available(), reason="no AMX tiles here"),
            )
            for arch, window in (("llama", None), ("qwen2", None), ("mistral", 3))
        ),  # bf16 weights on AMX tiles (qwen2: a bf16 q/k/v bias)
    ],
)
def test_stack_equals_the_op_by_op_forward_bitwise(
    arch, quantization, dtype, window, tmp_path, monkeypatch
):
    path = make_tiny_checkpoint(tmp_path / arch, arch, sliding_window=window)
    on, off = _load(path, quantization, dtype), _load(path, quantization, dtype)
    logits_on, caches_on, calls = _run(on, STEPS, True, monkeypatch)
    logits_off, caches_off, calls_off = _run(off, STEPS, False, monkeypatch)
    assert on.model._cpu_stack is not None and not calls_off
    assert calls == [8, 3, 5, 4, 2]  # every step but the 40-token prefill
    for step_on, step_off in zip(logits_on, logits_off, strict=True):
        for req in step_on:
            assert torch.equal(step_on[req], step_off[req]), req
    for a, b in zip(caches_on, caches_off, strict=True):
        assert torch.equal(a, b)


def test_models_outside_the_stack_say_why(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    assert cpu_stack.unsupported(_load(path, "int4", "float32").model) is None
    int8 = _load(path, "int4", "float32", quant_activations="int8").model
    assert cpu_stack.unsupported(int8) == "a projection outside the block kernels"
    dense = _load(path, "none", "float32").model
    assert cpu_stack.unsupported(dense) == "a FusedLinear projection"
    wrapped = _load(path, "int4", "float32").model
    ModelLoRA(wrapped, LoRAConfig(enabled=True))
    assert cpu_stack.unsupported(wrapped) == "a LoRALinear projection"


def test_env_switch_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_CPU_STACK", "off")
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    assert cpu_stack.unsupported(_load(path, "int4", "float32").model) == (
        "APPLIANCE_CPU_STACK is off"
    )
