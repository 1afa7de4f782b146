"""Tensor parallelism's failure modes: bad sizes refused at start, a killed worker.

- A size the model cannot be split by, LoRA, torch.compile, or (on CUDA) more ranks than
  GPUs or decode CUDA graphs: a ConfigError at start naming the key, before any process.
- A worker killed with SIGKILL while a request is mid-generation: the request fails with an
  error naming the rank and the signal, the engine turns unhealthy and refuses new work,
  nothing hangs, and no worker is left running. The worker is stopped (SIGSTOP) before it is
  killed, so the request cannot progress in between, whatever the box's speed.
- A worker that hangs (stopped for good) fails the engine once a step has waited
  `parallel.timeout_s` for it, with an error saying so; the hung worker is killed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import signal
from types import SimpleNamespace

import pytest

from engine.async_engine import AsyncEngine
from engine.config import ConfigError, EngineConfig, LoRAConfig, ParallelConfig, RuntimeConfig
from engine.errors import EngineDeadError, EngineError
from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker.distributed.checks import check_tensor_parallel
from tests.support.processes import is_running
from tests.support.waiting import HANG_S, wait_for

KEY = "parallel.tensor_parallel_size"


def _config(model_dir, tp: int = 2, **kw) -> EngineConfig:
    return build_engine_config(
        str(model_dir), tensor_parallel_size=tp, dtype="float32", device="cpu",
        num_kv_blocks=64, block_size=4, max_model_len=128, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    "overrides, tp, key, words",
    [
        ({}, 3, KEY, "does not divide the model's 4 attention heads"),
        (
            {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
            2,
            KEY,
            "3 KV heads",
        ),
        ({"intermediate_size": 130}, 4, KEY, "intermediate_size 130"),
    ],
    ids=["heads", "kv heads", "intermediate"],
)
def test_a_size_the_model_cannot_split_by_is_refused_before_any_process(
    tiny_checkpoint, overrides, tp, key, words
) -> None:
    model_dir = tiny_checkpoint("llama", **overrides)
    with pytest.raises(ConfigError) as e:
        LLMEngine(_config(model_dir, tp))
    assert e.value.key == key and words in str(e.value)
    assert not multiprocessing.active_children()


def test_lora_and_compile_are_refused_with_tensor_parallelism(tiny_llama_dir) -> None:
    base = _config(tiny_llama_dir)
    lora = dataclasses.replace(base, lora=LoRAConfig(enabled=True))
    compiled = dataclasses.replace(base, runtime=RuntimeConfig(device="cpu", compile=True))
    for config, key in ((lora, "lora.enabled"), (compiled, "runtime.compile")):
        with pytest.raises(ConfigError) as e:
            LLMEngine(config)
        assert e.value.key == key and KEY in str(e.value)
    assert not multiprocessing.active_children()


def test_cuda_ranks_beyond_the_visible_gpus_and_cuda_graphs_are_refused(tiny_llama_dir) -> None:
    """The CUDA-only checks, with the device facts given (this box has no GPU)."""
    hf = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    config = dataclasses.replace(
        _config(tiny_llama_dir), runtime=RuntimeConfig(device="cuda", cuda_graphs=False)
    )
    with pytest.raises(ConfigError) as e:
        check_tensor_parallel(config, hf, "cuda", 0, device_count=1)
    assert e.value.key == KEY and "1 GPU(s) are visible" in str(e.value)
    with pytest.raises(ConfigError) as e:
        check_tensor_parallel(config, hf, "cuda", 1, device_count=2)  # cuda:1 and cuda:2
    assert e.value.key == KEY
    check_tensor_parallel(config, hf, "cuda", 0, device_count=2)  # fits
    graphs = dataclasses.replace(config, runtime=RuntimeConfig(device="cuda", cuda_graphs=True))
    with pytest.raises(ConfigError) as e:
        check_tensor_parallel(graphs, hf, "cuda", 0, device_count=2)
    assert e.value.key == "runtime.cuda_graphs"


def _generate_until_the_worker_is_stopped(config: EngineConfig, kill: bool):
    """Starts a 100-token request on a TP=2 engine, stops the worker after the first token
    (and kills it if `kill`), and returns (engine, worker pid, tokens received, the error
    the stream ended with)."""
    engine = LLMEngine(config)
    (pid,) = engine.tp_workers.pids
    aeng = AsyncEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main() -> tuple[int, BaseException | None]:
        stream = await aeng.add_request([5, 6, 7, 8], params)
        got = len((await stream.__anext__()).outputs[0].token_ids)  # it is generating
        os.kill(pid, signal.SIGSTOP)  # from here the request cannot progress
        if kill:
            os.kill(pid, signal.SIGKILL)
        failure = None
        try:
            async for delta in stream:
                got += len(delta.outputs[0].token_ids)
        except EngineError as e:
            failure = e
        return got, failure

    try:
        got, failure = asyncio.run(asyncio.wait_for(main(), HANG_S))
        assert failure is not None and got < 100
        assert not aeng.is_healthy and aeng.dead_reason
        with pytest.raises(EngineDeadError):
            asyncio.run(aeng.add_request([5, 6], params))
    finally:
        asyncio.run(asyncio.wait_for(aeng.shutdown(), HANG_S))
    wait_for(lambda: not is_running(pid), "the worker gone")
    assert not multiprocessing.active_children()
    return aeng, failure


def test_a_worker_killed_mid_generation_fails_the_request_and_the_engine(tiny_llama_dir) -> None:
    aeng, failure = _generate_until_the_worker_is_stopped(_config(tiny_llama_dir), kill=True)
    assert "rank 1" in str(failure) and "SIGKILL" in str(failure), failure
    assert "rank 1" in aeng.dead_reason and "SIGKILL" in aeng.dead_reason


def test_a_hung_worker_fails_the_engine_after_the_parallel_timeout(tiny_llama_dir) -> None:
    """Stopped, never killed by the test: only the timeout can end the step."""
    config = dataclasses.replace(
        _config(tiny_llama_dir), parallel=ParallelConfig(tensor_parallel_size=2, timeout_s=3.0)
    )
    aeng, failure = _generate_until_the_worker_is_stopped(config, kill=False)
    assert "parallel.timeout_s=3s" in str(failure) and "hung" in str(failure), failure
