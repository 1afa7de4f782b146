"""The compiled model on the CPU: same greedy tokens as eager, no recompiles after warm-up.

Compiles are counted with a backend that wraps inductor. The first compile of the tiny model
takes about a minute on two cores (cached by inductor on disk afterwards), so the compiled
model is built once per module.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch._inductor.compile_fx import compile_fx

from engine.config import ModelConfig, RuntimeConfig
from engine.worker.attention.base import AttentionBackend
from engine.worker.attention.torch_paged import TorchPagedBackend
from engine.worker.compiled_model import CompiledModel, EagerAttention
from engine.worker.models.loader import load_model
from engine.worker.runner import ModelRunner
from graphs.compile import CACHE_ENV
from tests.support.paged_harness import PagedRun


class CountingInductor:
    """A torch.compile backend: inductor, counting each graph it is asked to compile."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return compile_fx(gm, example_inputs)


class RecordingBackend(TorchPagedBackend):
    """The torch backend, noting the tensor type it was called with (real, not traced)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[type] = []

    def forward(self, q, k, v, kv_cache, metadata, layer):
        self.calls.append(type(q))
        return super().forward(q, k, v, kv_cache, metadata, layer)


def _load(model_dir) -> torch.nn.Module:
    return load_model(ModelConfig(path=str(model_dir)), torch.device("cpu")).model


def _greedy(model, backend: AttentionBackend, schedule: list[list[int]]) -> dict[int, list[int]]:
    """Prefill prompts in chunks (`schedule` rows: chunk length per request), then decode."""
    run = PagedRun(model, backend, num_blocks=96, block_size=4)
    prompts = {r: [(5 * r + j) % 300 + 2 for j in range(11 + r)] for r in range(6)}
    fed = dict.fromkeys(prompts, 0)
    out: dict[int, list[int]] = {r: [] for r in prompts}
    for row in schedule:
        chunks = {}
        for r, n in enumerate(row):
            if n == 0:
                continue
            if fed[r] < len(prompts[r]):
                chunks[r] = prompts[r][fed[r] : fed[r] + n]
                fed[r] += len(chunks[r])
            else:
                chunks[r] = out[r][-1:]
        for r, logits in run.step(chunks).items():
            if fed[r] == len(prompts[r]):
                out[r].append(int(logits[-1].argmax()))
    return out


# Each row: tokens per request in that step; prompts finish at different steps, then the
# live batch decodes with sizes 6, 5, 3, 2, 1 and mixes prefill chunks with decodes.
SCHEDULE = [
    [4, 4, 0, 0, 0, 0],
    [4, 4, 6, 0, 0, 0],
    [3, 4, 6, 5, 0, 0],
    [1, 1, 2, 5, 16, 17],
    [1, 1, 1, 4, 1, 1],
    [1, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 1, 0],
    [1, 1, 0, 1, 0, 0],
    [1, 1, 0, 0, 0, 0],
    [0, 1, 0, 0, 0, 0],
]


@pytest.fixture(scope="module")
def compiled(tiny_llama_dir):
    counter = CountingInductor()
    model = CompiledModel(_load(tiny_llama_dir), backend=counter)
    # Warm-up: one multi-token step and one single-token step (dynamo specialises size 1).
    _greedy(model, TorchPagedBackend(), [[5, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    return model, counter


def test_compiled_greedy_tokens_equal_eager(compiled, tiny_llama_dir):
    model, _ = compiled
    expected = _greedy(_load(tiny_llama_dir), TorchPagedBackend(), SCHEDULE)
    assert _greedy(model, TorchPagedBackend(), SCHEDULE) == expected
    assert all(len(toks) >= 3 for toks in expected.values())


def test_no_recompile_across_batch_sizes_after_warmup(compiled):
    model, counter = compiled
    after_warmup = counter.graphs
    assert after_warmup > 0
    _greedy(model, TorchPagedBackend(), SCHEDULE)
    _greedy(model, TorchPagedBackend(), [[2, 3, 4, 5, 6, 7]] + [[1] * 6] * 3)
    assert counter.graphs == after_warmup


def test_attention_runs_eagerly_every_step(compiled):
    model, _ = compiled
    backend = RecordingBackend()
    _greedy(model, backend, [[3, 2, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    assert len(backend.calls) == 2 * model.num_layers  # every step, every layer, not baked in
    assert set(backend.calls) == {torch.Tensor}  # real tensors, not dynamo's fakes


def _runner(model, **runtime) -> ModelRunner:
    return ModelRunner(model, torch.device("cpu"), torch.float32, 4, RuntimeConfig(**runtime))


def test_runner_compiles_only_when_asked_and_then_leaves_the_cpu_kernels_off(tiny_llama_dir):
    model = _load(tiny_llama_dir)
    assert _runner(model, compile=False, cpu_kernels=False).model is model
    compiled = _runner(_load(tiny_llama_dir), compile=True, cpu_kernels=True).model
    assert isinstance(compiled, CompiledModel)
    assert not compiled.model._cpu_fused  # inductor compiles the plain ops instead


def test_cache_dir_is_exported_when_the_runner_compiles(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "placeholder")  # so teardown restores the original value
    monkeypatch.delenv(CACHE_ENV)
    target = tmp_path / "inductor-cache"
    model = _load(tiny_llama_dir)
    wrapped = _runner(model, compile=True, compile_cache_dir=str(target)).model
    assert os.environ[CACHE_ENV] == str(target.resolve())
    assert target.is_dir()
    # The wrapper keeps the model's interface for the runner.
    assert wrapped.num_layers == model.num_layers
    assert wrapped.attention_specs == model.attention_specs
    hidden = torch.randn(2, model.config.hidden_size)
    assert torch.equal(wrapped.compute_logits(hidden), model.compute_logits(hidden))


def test_eager_attention_proxy_delegates_hooks():
    inner = TorchPagedBackend()
    proxy = EagerAttention(inner)
    assert proxy.name == "torch"
    assert proxy.write_kv is inner.write_kv  # attributes fall through to the real backend


def test_llm_with_compile_matches_eager_tokens(tiny_llama_dir, compiled):
    from engine import LLM, SamplingParams

    kw = dict(num_kv_blocks=96, block_size=4, dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[3, 17, 42, 9], [5, 6, 7], [11] * 9]
    eager = LLM(str(tiny_llama_dir), **kw).generate(prompts, params, use_tqdm=False)
    fast = LLM(str(tiny_llama_dir), compile=True, **kw)
    assert isinstance(fast.engine.runner.model, CompiledModel)
    got = fast.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in eager]
