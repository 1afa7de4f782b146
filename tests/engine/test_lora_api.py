"""The LoRA surface of LLMEngine and AsyncEngine: load, list, remove (never under a running
request), conflicts, per-adapter counts, and the start-up refusals. Waits on states (a
`StepGate` holds steps), never on the clock."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import ConfigError, EngineConfig, LoRAConfig, RuntimeConfig
from engine.errors import LoRAError, LoRANotFoundError
from engine.llm import build_engine_config
from engine.worker.lora.model_lora import check_lora_runtime
from tests.support.tiny_lora import make_tiny_adapter, peft_greedy
from tests.support.waiting import StepGate, wait_for_async

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("api-adapters")
    return {
        name: str(make_tiny_adapter(tiny_llama_dir, root / name, r=4, seed=seed))
        for name, seed in (("a", 1), ("b", 2))
    }


def _tokens(delta) -> list[int]:
    return [t for sample in delta.outputs for t in sample.token_ids]


# The small LoRA engine every test here runs.
_SETTINGS = dict(
    enable_lora=True, num_kv_blocks=64, block_size=4, dtype="float32", max_model_len=128
)


def _llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), **_SETTINGS, **kw)


def _async_engine(model_dir) -> AsyncEngine:
    return AsyncEngine.from_config(build_engine_config(str(model_dir), **_SETTINGS))


def test_add_is_idempotent_and_conflicts_are_refused(tiny_llama_dir, paths):
    engine = _llm(tiny_llama_dir).engine
    a = LoRARequest("a", 1, paths["a"])
    engine.add_lora(a)
    engine.add_lora(a)
    assert engine.list_loras() == [a] and engine.is_lora_loaded(a)
    with pytest.raises(LoRAError, match=r"'a' is loaded from .* remove it before"):
        engine.add_lora(LoRARequest("a", 1, paths["b"]))
    with pytest.raises(LoRAError, match="lora_int_id 1 is already used by LoRA adapter 'a'"):
        engine.add_lora(LoRARequest("b", 1, paths["b"]))
    with pytest.raises(LoRANotFoundError, match="no LoRA adapter named 'b'"):
        engine.remove_lora("b")
    engine.remove_lora("a")  # unused: dropped at once
    assert engine.list_loras() == [] and not engine.lora_in_use("a")
    engine.add_lora(LoRARequest("a", 1, paths["b"]))  # the name is free again


def test_a_bad_adapter_fails_the_generate_call_with_its_reason(tiny_llama_dir, tmp_path):
    llm = _llm(tiny_llama_dir)
    with pytest.raises(LoRAError, match=r"LoRA adapter 'gone' .*: the directory does not exist"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("gone", 3, str(tmp_path / "x")))
    assert not llm.engine.has_unfinished_requests()


def test_lora_off_refuses_adapters(tiny_llama_dir, paths):
    llm = LLM(
        str(tiny_llama_dir), num_kv_blocks=64, block_size=4, dtype="float32", max_model_len=128
    )
    with pytest.raises(LoRAError, match="LoRA adapters are off: set lora.enabled"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("a", 1, paths["a"]))
    assert llm.engine.list_loras() == [] and llm.engine.runner.lora is None


def test_graphs_and_compile_are_refused_at_start_with_lora():
    lora = LoRAConfig(enabled=True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^runtime.cuda_graphs: "):
        check_lora_runtime(EngineConfig(lora=lora), cuda)
    check_lora_runtime(EngineConfig(lora=lora), cpu)  # no graphs on the CPU: nothing to refuse
    check_lora_runtime(EngineConfig(lora=lora, runtime=RuntimeConfig(cuda_graphs=False)), cuda)
    with pytest.raises(ConfigError, match=r"^runtime.compile: "):
        LLM(enable_lora=True, compile=True)  # refused before the model is loaded


def test_remove_waits_for_running_requests_and_refuses_new_ones(tiny_llama_dir, paths):
    engine = _llm(tiny_llama_dir, max_num_seqs=1).engine
    a, b = LoRARequest("a", 1, paths["a"]), LoRARequest("b", 2, paths["b"])
    engine.add_request("ra", [5, 6, 7], GREEDY, lora_request=a)
    engine.add_request("rb", [5, 6, 7], GREEDY, lora_request=b)
    engine.add_request("base", [5, 6, 7], GREEDY)
    tokens = [t for d in engine.step() if d.request_id == "ra" for t in _tokens(d)]
    stats = engine.stats()
    assert (stats.lora_running, stats.lora_waiting) == ({"a": 1}, {"b": 1})
    engine.remove_lora("a")
    assert engine.list_loras() == [b] and engine.lora_in_use("a")
    with pytest.raises(LoRAError, match="LoRA adapter 'a' is being removed"):
        engine.add_request("late", [5, 6, 7], GREEDY, lora_request=a)
    while engine.has_unfinished_requests():
        tokens += [t for d in engine.step() if d.request_id == "ra" for t in _tokens(d)]
    assert not engine.lora_in_use("a")
    assert tokens == peft_greedy(tiny_llama_dir, paths["a"], [[5, 6, 7]], 8)[0]
    engine.add_request("again", [5, 6, 7], GREEDY, lora_request=a)  # loads it anew
    assert engine.list_loras() == [b, a]


def test_cpu_cache_evicts_least_recently_used_adapters(tiny_llama_dir, paths):
    engine = _llm(tiny_llama_dir, max_loras=1, max_cpu_loras=1).engine
    a, b = LoRARequest("a", 1, paths["a"]), LoRARequest("b", 2, paths["b"])
    engine.add_lora(a)
    engine.add_lora(b)
    assert engine.list_loras() == [b]
    engine.add_request("ra", [5, 6, 7], GREEDY, lora_request=a)  # read again from its path
    assert engine.list_loras() == [a]


def test_async_remove_returns_once_the_running_request_finished(tiny_llama_dir, paths):
    aeng = _async_engine(tiny_llama_dir)
    gate = StepGate(aeng.engine, permits=1)  # the prefill, then held: it cannot finish
    a = LoRARequest("a", 1, paths["a"])

    async def main() -> list[int]:
        await aeng.add_lora(a)
        stream = aeng.generate([5, 6, 7], GREEDY, lora_request=a)
        tokens = _tokens(await stream.__anext__())
        assert aeng.stats().lora_running == {"a": 1}
        removal = asyncio.create_task(aeng.remove_lora("a"))
        await wait_for_async(lambda: aeng.list_loras() == [], "removal begun")
        with pytest.raises(LoRAError, match="'a' is being removed"):
            await aeng.add_request([5, 6], GREEDY, lora_request=a)
        assert not removal.done()  # steps are held: its request is still running
        gate.open()
        async for delta in stream:
            tokens += _tokens(delta)
        await removal
        assert not aeng.engine.lora_in_use("a")
        with pytest.raises(LoRANotFoundError):
            await aeng.remove_lora("a")
        await aeng.shutdown()
        return tokens

    assert asyncio.run(main()) == peft_greedy(tiny_llama_dir, paths["a"], [[5, 6, 7]], 8)[0]


def test_async_adapter_files_are_read_off_the_event_loop_and_engine_threads(
    tiny_llama_dir, paths, monkeypatch
):
    import threading

    from engine.worker.lora import registry

    readers = []
    load = registry.load_peft_adapter

    def recording_load(*args, **kw):
        readers.append(threading.current_thread())
        return load(*args, **kw)

    monkeypatch.setattr(registry, "load_peft_adapter", recording_load)
    aeng = _async_engine(tiny_llama_dir)

    async def main() -> None:
        await aeng.add_lora(LoRARequest("a", 1, paths["a"]))
        b = LoRARequest("b", 2, paths["b"])  # loaded by its first request
        async for _ in aeng.generate([5, 6, 7], GREEDY, lora_request=b):
            pass
        await aeng.shutdown()

    loop_thread = threading.current_thread()
    asyncio.run(main())
    assert len(readers) == 2
    assert all(t is not loop_thread and t is not aeng._thread for t in readers)
