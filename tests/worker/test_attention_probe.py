"""Start-up choice of the attention backend and graph mode, with the fallbacks, on the CPU.

`runtime.attention_backend` auto/flashinfer/torch is driven with stand-in flashinfer modules
(tests/support/fake_flashinfer.py): one that works (its wrappers follow FlashInfer's contract),
one whose `plan()` raises like a failed JIT build, one that plans without the sliding window
(wrong attention the probe must catch), one of another release. A graph recorder that raises
stands for a failed CUDA graph capture.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, ModelConfig, RuntimeConfig
from engine.worker.attention.base import AttentionLayerSpec
from engine.worker.attention.probe import AttentionProbeError, probe_attention
from engine.worker.attention.selection import select_attention_backend
from engine.worker.models.loader import load_model
from engine.worker.runner import ModelRunner
from tests.support.fake_flashinfer import FakeFlashInfer, _FakePrefill, _FakeWrapper
from tests.support.fake_graphs import ReplayGraph

CPU = torch.device("cpu")
BF16 = torch.bfloat16
SPECS = [AttentionLayerSpec(4, 2, 8, 8**-0.5), AttentionLayerSpec(4, 2, 8, 8**-0.5, 6)]


def _module(name: str, **attrs) -> type:
    return type(name, (FakeFlashInfer,), attrs)


def _plan_raises(self, *args, **kwargs):
    raise RuntimeError("ninja: build stopped: subcommand failed (batch_decode)")


def _plan_without_window(self, *args, window_left=-1, **kwargs):
    _FakeWrapper.plan(self, *args, **kwargs)  # the window never reaches the kernel


FAILING_PLAN = _module(
    "FailingPlan",
    BatchDecodeWithPagedKVCacheWrapper=type("D", (_FakeWrapper,), {"plan": _plan_raises}),
    BatchPrefillWithPagedKVCacheWrapper=type("P", (_FakePrefill,), {"plan": _plan_raises}),
)
NO_WINDOW = _module(
    "NoWindow",
    BatchDecodeWithPagedKVCacheWrapper=type("D", (_FakeWrapper,), {"plan": _plan_without_window}),
    BatchPrefillWithPagedKVCacheWrapper=type("P", (_FakePrefill,), {"plan": _plan_without_window}),
)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(ModelConfig(path=str(tiny_llama_dir), dtype="bfloat16"), CPU).model


def _runner(model, setting: str, module, **runtime) -> ModelRunner:
    rt = RuntimeConfig(attention_backend=setting, **runtime)
    return ModelRunner(model, CPU, BF16, 4, rt, flashinfer_module=module)


def test_a_working_flashinfer_passes_the_probe_with_both_wrappers_warm(model):
    runner = _runner(model, "auto", FakeFlashInfer)
    assert runner.backend.name == "flashinfer"
    assert runner.status.attention_fallback_reason is None
    kinds = set(model.attention_specs)
    decode, prefill = runner.backend._decode, runner.backend._prefill
    assert len(decode) == len(prefill) == len(kinds)  # one of each per kind of layer
    for wrapper in [*decode.values(), *prefill.values()]:
        assert wrapper.plans and wrapper.runs  # planned and run: JIT built, allocations done
    assert {p["causal"] for w in prefill.values() for p in w.plans} == {True}


def test_auto_falls_back_to_torch_when_plan_raises_and_says_why(model):
    runner = _runner(model, "auto", FAILING_PLAN)
    assert runner.backend.name == "torch"
    assert runner.status.attention_backend == "torch"
    assert "ninja: build stopped" in runner.status.attention_fallback_reason
    assert runner.status.fallbacks() == {"attention": runner.status.attention_fallback_reason}


def test_flashinfer_setting_stops_start_up_with_the_reason(model):
    with pytest.raises(ConfigError, match="ninja: build stopped") as info:
        _runner(model, "flashinfer", FAILING_PLAN)
    assert info.value.key == "runtime.attention_backend"


def test_torch_setting_never_tries_flashinfer(model):
    runner = _runner(model, "torch", FAILING_PLAN)
    assert runner.backend.name == "torch"
    assert runner.status.fallbacks() == {}


def test_another_flashinfer_release_falls_back_under_auto():
    choice = select_attention_backend(
        CPU, BF16, specs=SPECS, block_size=4, flashinfer_module=_module("Old", __version__="0.6.9")
    )
    assert choice.backend.name == "torch"
    assert "flashinfer 0.6.9 is not a 0.7.x release" in choice.fallback_reason


def test_probe_catches_attention_that_ignores_the_sliding_window():
    choice = select_attention_backend(
        CPU, BF16, specs=SPECS, block_size=4, flashinfer_module=NO_WINDOW
    )
    assert choice.backend.name == "torch"
    assert "AttentionProbeError" in choice.fallback_reason
    assert "sliding_window=6" in choice.fallback_reason
    # Without a windowed layer the same module is right, and passes.
    ok = select_attention_backend(
        CPU, BF16, specs=SPECS[:1], block_size=4, flashinfer_module=NO_WINDOW
    )
    assert ok.backend.name == "flashinfer" and ok.fallback_reason is None


def test_a_float32_model_does_not_run_flashinfer():
    choice = select_attention_backend(
        CPU, torch.float32, specs=SPECS, block_size=4, flashinfer_module=FakeFlashInfer
    )
    assert choice.backend.name == "torch"
    assert "fp16/bf16" in choice.fallback_reason


def test_on_the_cpu_auto_is_the_torch_backend_without_a_fallback():
    choice = select_attention_backend(CPU, torch.float32, specs=SPECS, block_size=4)
    assert (choice.backend.name, choice.fallback_reason) == ("torch", None)
    with pytest.raises(ConfigError, match="CUDA device"):
        select_attention_backend(CPU, BF16, setting="flashinfer", specs=SPECS, block_size=4)


def test_probe_runs_decode_and_causal_prefill_per_kind_of_layer():
    from tests.support.fake_flashinfer import fake_backend

    backend = fake_backend()
    backend.cache_dtypes = (BF16,)
    probe_attention(backend, [SPECS[0], SPECS[1], SPECS[0]], 4, BF16, CPU)
    assert len(backend._decode) == len(backend._prefill) == 2
    windowed = [w for k, w in backend._decode.items() if k.window_left == 5]
    # Contexts span more than the window and more than two blocks.
    assert windowed and int(windowed[0].plans[-1]["indptr"][1]) * 4 > 6 + 4


def test_probe_error_names_the_disagreement():
    from engine.worker.attention.torch_paged import TorchPagedBackend

    class ZeroBackend(TorchPagedBackend):
        def forward(self, q, k, v, kv_cache, metadata, layer):
            super().forward(q, k, v, kv_cache, metadata, layer)
            return torch.zeros_like(q)

    with pytest.raises(AttentionProbeError, match="decode probe .* differ from the torch"):
        probe_attention(ZeroBackend(native=False), SPECS[:1], 4, BF16, CPU)


def test_failed_graph_capture_leaves_decode_eager_with_the_reason(model):
    runner = _runner(model, "auto", FakeFlashInfer, capture_sizes=(1, 2))
    runner.allocate_kv_cache(16)

    def failing_factory(body, pool):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    runner.capture_graphs(max_num_seqs=2, max_model_len=32, graph_factory=failing_factory)
    assert runner.graph_runner is None
    assert runner.status.decode_graphs is False
    assert "operation not permitted" in runner.status.graphs_fallback_reason
    assert set(runner.status.fallbacks()) == {"decode_graphs"}


def test_successful_capture_reports_decode_graphs(model):
    runner = _runner(model, "auto", FakeFlashInfer, capture_sizes=(1, 2))
    runner.allocate_kv_cache(16)
    runner.capture_graphs(2, 32, graph_factory=lambda body, pool: (ReplayGraph(body), pool))
    assert runner.graph_runner is not None and sorted(runner.graph_runner.graphs) == [1, 2]
    assert runner.status.decode_graphs and runner.status.fallbacks() == {}


def test_llm_with_flashinfer_setting_on_the_cpu_stops_with_the_key(tiny_llama_dir):
    from engine import LLM

    with pytest.raises(ConfigError, match="runtime.attention_backend: flashinfer cannot run"):
        LLM(str(tiny_llama_dir), device="cpu", attention_backend="flashinfer")
