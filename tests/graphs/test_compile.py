"""compile_dynamic and run_eagerly on plain functions: dynamic shapes, graph breaks, cache dir.

Compiles are counted with a backend that runs the traced graph as is (no inductor), so these
tests take seconds; the engine's compiled model is tested in tests/worker/test_compiled_model.py.
"""

from __future__ import annotations

import os

import torch

from graphs.compile import CACHE_ENV, compile_dynamic, run_eagerly


class CountingEager:
    """A torch.compile backend: the traced graph unchanged, counting each one it is given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return gm.forward


def test_one_compile_serves_every_size_above_one():
    counter = CountingEager()
    fn = compile_dynamic(lambda x: (x * 2).sum(0), backend=counter)
    for n in (2, 3, 5, 17):
        assert torch.equal(fn(torch.ones(n, 4)), torch.full((4,), 2.0 * n))
    assert counter.graphs == 1  # dynamic from the first call: no static-then-dynamic recompile


def test_run_eagerly_is_a_graph_break_called_with_real_tensors():
    seen: list[type] = []

    @run_eagerly
    def planning(x: torch.Tensor) -> torch.Tensor:
        seen.append(type(x))
        return x + len(x.tolist())  # host work dynamo must not trace

    counter = CountingEager()
    fn = compile_dynamic(lambda x: planning(x * 2) * 3, backend=counter)
    assert fn(torch.ones(3)).tolist() == [15.0, 15.0, 15.0]
    assert fn(torch.ones(4)).tolist() == [18.0] * 4
    assert seen == [torch.Tensor, torch.Tensor]
    assert counter.graphs == 2  # the code before the break and the code after it


def test_cache_dir_is_exported_when_compiling_not_at_import(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "placeholder")  # so teardown restores the original value
    monkeypatch.delenv(CACHE_ENV)
    import graphs.compile  # noqa: F401 - importing must not touch the environment

    assert CACHE_ENV not in os.environ
    target = tmp_path / "inductor-cache"
    compile_dynamic(lambda x: x + 1, cache_dir=str(target), backend=CountingEager())
    assert os.environ[CACHE_ENV] == str(target.resolve())
    assert target.is_dir()
