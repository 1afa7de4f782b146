"""AsyncEngine: the engine loop on its thread, streams, aborts, failures, shutdown.

Most tests drive a `FakeLLMEngine` (deterministic tokens, injectable step failures); the
last ones run the real LLMEngine on the tiny checkpoint. Where a test needs a request still
running, a `StepGate` holds the engine's steps: no test here waits on the clock.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine, FinishedRequest
from engine.errors import EngineDeadError, InvalidRequestError, QueueFullError, RequestFailedError
from engine.sampling_params import SamplingParams
from tests.support.fake_engine import FakeLLMEngine
from tests.support.waiting import HANG_S, StepGate, wait_for_async


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_S))


async def _collect(aeng: AsyncEngine, prompt, **kw):
    """The request's whole output, summed from the deltas its stream hands out."""
    stream = await aeng.add_request(prompt, SamplingParams(**kw))
    return await stream.result()


def test_generate_streams_deltas_until_finished_on_the_engine_thread():
    fake = FakeLLMEngine()
    aeng = AsyncEngine(fake)

    async def main():
        deltas = [d async for d in aeng.generate("hi", SamplingParams(max_tokens=3))]
        await aeng.shutdown()
        return deltas

    deltas = run(main())
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.outputs[0].text for d in deltas) == "cde"
    assert [t for d in deltas for t in d.outputs[0].token_ids] == [ord(c) for c in "cde"]
    assert [d.outputs[0].finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert threading.get_ident() not in fake.thread_ids and len(fake.thread_ids) == 1


def test_many_concurrent_requests_each_get_their_own_output():
    aeng = AsyncEngine(FakeLLMEngine(max_num_seqs=3, max_queue_len=64))

    async def main():
        res = await asyncio.gather(
            *[_collect(aeng, "x" * i, max_tokens=2 + i % 3) for i in range(1, 11)]
        )
        await aeng.shutdown()
        return res

    for i, out in enumerate(run(main()), start=1):
        assert out.finished
        assert len(out.outputs[0].token_ids) == 2 + i % 3
        assert out.prompt_token_ids == [ord("x")] * i


def test_a_consumer_that_falls_behind_gets_its_pending_deltas_coalesced_not_dropped():
    fake = FakeLLMEngine()
    aeng = AsyncEngine(fake)
    gate = StepGate(fake, permits=1)
    k = 5  # steps the consumer does not read

    async def main():
        stream = await aeng.add_request("hi", SamplingParams(n=2, max_tokens=k + 1))
        first = await stream.__anext__()  # step 1
        gate.allow(k)
        await wait_for_async(lambda: gate.steps == 1 + k, "k more steps")
        # Acknowledged in a later engine iteration than the k steps' deliveries, so by the
        # time it returns every one of them has reached the stream.
        marker = await aeng.add_request("z", SamplingParams(max_tokens=1))
        rest = await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        marker.abort()
        await aeng.shutdown()
        return first, rest, stream.output()

    first, rest, whole = run(main())

    def token(sample: int, position: int) -> int:  # the fake's tokens for prompt "hi"
        return ord("a") + (2 + position + sample) % 26

    assert [(s.index, s.token_ids) for s in first.outputs] == [
        (0, [token(0, 0)]),
        (1, [token(1, 0)]),
    ]
    assert rest.finished and [s.index for s in rest.outputs] == [0, 1]  # one item per choice
    for s in rest.outputs:
        assert s.token_ids == [token(s.index, j) for j in range(1, k + 1)]  # all k, in order
        assert s.text == "".join(map(chr, s.token_ids)) and s.finish_reason == "length"
    assert [len(c.token_ids) for c in whole.outputs] == [k + 1, k + 1]


def test_invalid_request_raises_before_streaming():
    aeng = AsyncEngine(FakeLLMEngine(max_model_len=8))

    async def main():
        with pytest.raises(InvalidRequestError) as ei:
            await aeng.add_request("x" * 20, SamplingParams())
        await aeng.shutdown()
        return ei.value

    assert run(main()).param == "prompt"


def test_closing_the_iterator_aborts_the_request_in_the_engine():
    fake = FakeLLMEngine()
    aeng = AsyncEngine(fake)
    StepGate(fake, permits=1)  # one token, then held: the request cannot finish

    async def main():
        agen = aeng.generate("hi", SamplingParams(max_tokens=50), request_id="r1")
        await agen.__anext__()
        await agen.aclose()
        await wait_for_async(lambda: not fake.has_unfinished_requests(), "r1 aborted")
        await aeng.shutdown()

    run(main())
    assert fake.aborted == ["r1"] and not fake.has_unfinished_requests()
    assert aeng.num_in_flight == 0


def test_cancelling_the_consumer_task_aborts_the_request():
    fake = FakeLLMEngine()
    aeng = AsyncEngine(fake)
    gate = StepGate(fake, permits=1)

    async def main():
        task = asyncio.create_task(_collect(aeng, "hi", max_tokens=500))
        await wait_for_async(lambda: gate.steps == 1, "the request running")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for_async(lambda: not fake.has_unfinished_requests(), "the request aborted")
        await aeng.shutdown()

    run(main())
    assert len(fake.aborted) == 1 and not fake.has_unfinished_requests()


def test_queue_full_is_refused_and_running_requests_are_unaffected():
    fake = FakeLLMEngine(max_num_seqs=1, max_queue_len=1)
    aeng = AsyncEngine(fake)
    gate = StepGate(fake, permits=1)  # the first request is admitted, then steps are held

    async def main():
        first = asyncio.create_task(_collect(aeng, "a", max_tokens=20))
        await wait_for_async(lambda: gate.steps == 1, "the first request running")
        second = await aeng.add_request("b", SamplingParams(max_tokens=2))  # waits
        with pytest.raises(QueueFullError):
            await aeng.add_request("c", SamplingParams(max_tokens=2))
        gate.open()
        out = await first
        second_out = await second.result()
        await aeng.shutdown()
        return out, second_out

    out, second_out = run(main())
    assert out.finished and len(out.outputs[0].token_ids) == 20
    assert second_out.finished


def test_failing_step_fails_requests_in_flight_and_the_engine_keeps_serving():
    fake = FakeLLMEngine()
    aeng = AsyncEngine(fake)
    finished: list[FinishedRequest] = []
    aeng.add_finish_listener(finished.append)

    async def main():
        fake.fail_steps = 1
        with pytest.raises(RequestFailedError, match="injected step failure"):
            await _collect(aeng, "hi", max_tokens=3)
        assert aeng.is_healthy
        outs = await _collect(aeng, "hi", max_tokens=3)
        await aeng.shutdown()
        return outs

    assert run(main()).finished
    assert [f.finish_reason for f in finished] == ["error", "length"]
    assert aeng.num_failed_steps == 1


def test_consecutive_failing_steps_mark_the_engine_dead():
    fake = FakeLLMEngine()
    aeng = AsyncEngine(fake, max_consecutive_failures=3)

    async def main():
        fake.fail_steps = 100
        for _ in range(3):
            with pytest.raises((RequestFailedError, EngineDeadError)):
                await _collect(aeng, "hi", max_tokens=3)
        with pytest.raises(EngineDeadError):
            await aeng.add_request("hi", SamplingParams())

    run(main())
    assert not aeng.is_healthy and "consecutive" in aeng.dead_reason


def test_shutdown_lets_in_flight_requests_finish_within_the_grace_period():
    fake = FakeLLMEngine()
    aeng = AsyncEngine(fake)
    gate = StepGate(fake)  # held until shutdown has begun: the request is surely in flight

    async def main():
        task = asyncio.create_task(_collect(aeng, "hi", max_tokens=10))
        await wait_for_async(lambda: aeng.num_in_flight == 1, "the request in flight")
        shutdown = asyncio.create_task(aeng.shutdown(grace_s=HANG_S))
        await wait_for_async(lambda: not aeng.is_accepting, "shutdown begun")
        gate.open()
        await shutdown  # returns once the request has finished, not after the grace
        with pytest.raises(EngineDeadError):
            await aeng.add_request("hi", SamplingParams())
        return await task

    assert run(main()).finished


def test_shutdown_aborts_what_outlives_the_grace_period():
    fake = FakeLLMEngine()
    aeng = AsyncEngine(fake)
    gate = StepGate(fake, permits=1)  # one token, then held: it outlives any grace period

    async def main():
        task = asyncio.create_task(_collect(aeng, "hi", max_tokens=1000))
        await wait_for_async(lambda: gate.steps == 1, "the request running")
        await aeng.shutdown(grace_s=0.1)  # a shutdown that waited for the request would hang
        with pytest.raises(EngineDeadError, match="shutting down"):
            await task

    run(main())
    assert not fake.has_unfinished_requests()


def test_two_event_loops_share_one_engine():
    aeng = AsyncEngine(FakeLLMEngine())
    results: list = []

    def other_loop():
        results.append(asyncio.run(_collect(aeng, "abc", max_tokens=4)))

    t = threading.Thread(target=other_loop)
    t.start()
    mine = run(_collect(aeng, "ab", max_tokens=4))
    t.join(HANG_S)
    assert mine.finished and results[0].finished
    run(aeng.shutdown())


# ---- the real engine on the tiny checkpoint ------------------------------------------------
def _real(model_dir, **sched):
    from engine.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        RuntimeConfig,
        SchedulerConfig,
    )

    cfg = EngineConfig(
        model=ModelConfig(path=str(model_dir), max_model_len=128),
        cache=CacheConfig(block_size=16, num_kv_blocks=48),
        scheduler=SchedulerConfig(**{"max_num_seqs": 4, **sched}),
        runtime=RuntimeConfig(device="cpu", num_threads=1),
    )
    return AsyncEngine.from_config(cfg)


async def _wait_kv_free(aeng: AsyncEngine) -> None:
    def free() -> bool:
        s = aeng.stats()
        return s.kv_usage == 0 and s.num_running == 0 and s.num_waiting == 0

    await wait_for_async(free, f"blocks freed ({aeng.stats()})")


def test_real_engine_concurrent_greedy_matches_transformers(tiny_llama_dir, hf_greedy):
    aeng = _real(tiny_llama_dir, max_num_seqs=2)  # 4 requests, 2 at a time: queueing too
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]

    async def main():
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        res = await asyncio.gather(*[_collect(aeng, p, **params.__dict__) for p in prompts])
        await _wait_kv_free(aeng)
        await aeng.shutdown()
        return [out.outputs[0].token_ids for out in res]

    assert run(main()) == hf_greedy(tiny_llama_dir, prompts, 6, ignore_eos=True)


def test_real_engine_abort_frees_blocks_without_another_step(tiny_llama_dir):
    aeng = _real(tiny_llama_dir)
    StepGate(aeng.engine, permits=1)  # prefill, then held: it cannot finish

    async def main():
        agen = aeng.generate([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
        await agen.__anext__()
        assert aeng.stats().kv_usage > 0
        await agen.aclose()
        await _wait_kv_free(aeng)  # still held: the abort itself frees the blocks
        await aeng.shutdown()

    run(main())


def test_real_engine_step_failure_fails_the_request_and_frees_its_blocks(tiny_llama_dir):
    aeng = _real(tiny_llama_dir)
    runner = aeng.engine.runner
    execute = runner.execute
    calls = {"n": 0}

    def flaky(so):
        calls["n"] += 1
        if calls["n"] == 3:  # after prefill and one decode
            raise RuntimeError("simulated device error")
        return execute(so)

    runner.execute = flaky

    async def main():
        with pytest.raises(RequestFailedError, match="simulated device error"):
            await _collect(aeng, [5, 6, 7], max_tokens=20, ignore_eos=True)
        await _wait_kv_free(aeng)
        outs = await _collect(aeng, [5, 6, 7], max_tokens=3, ignore_eos=True)
        assert aeng.is_healthy
        await aeng.shutdown()
        return outs

    assert len(run(main()).outputs[0].token_ids) == 3
