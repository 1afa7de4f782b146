"""A burst of gRPC calls larger than the queue: every refusal is RESOURCE_EXHAUSTED.

Clients retry RESOURCE_EXHAUSTED (the queue is full, try later) but not CANCELLED. gRPC
core holds the calls the event loop has not taken yet in a backlog, and by default sheds
it as CANCELLED past 1,000 calls (some at random, all past 3,000). A burst of 2,000
Generate calls on one channel builds such a backlog while the loop handles the first ones;
the server's own bound (`server.grpc_max_pending_calls`) is set so that every call reaches
admission. The engine's steps are held, so the queue is surely full for the whole burst.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import grpc

from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from tests.support.grpc_harness import start_harness, tiny_llm_engine
from tests.support.waiting import HANG_S, StepGate, wait_for_async

NUM_CALLS = 2000
MAX_QUEUE_LEN = 8
MAX_NUM_SEQS = 4


async def _generate(stub: pb_grpc.ApplianceStub) -> str:
    req = pb.GenerateRequest(
        text="hello there", sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)
    )
    try:
        responses = [r async for r in stub.Generate(req)]
    except grpc.aio.AioRpcError as e:
        return e.code().name
    assert responses[-1].finish_reason == "length"
    return "OK"


def test_burst_over_the_queue_is_refused_resource_exhausted_never_cancelled(
    tiny_llama_dir: Path,
) -> None:
    llm = tiny_llm_engine(tiny_llama_dir, max_queue_len=MAX_QUEUE_LEN, max_num_seqs=MAX_NUM_SEQS)
    h = start_harness(llm)
    gate = StepGate(llm)
    held = MAX_QUEUE_LEN + MAX_NUM_SEQS  # at most: the waiting queue and the running batch

    async def main() -> Counter:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            calls = [asyncio.ensure_future(_generate(stub)) for _ in range(NUM_CALLS)]
            # Every call but those the engine holds has its answer before a step runs.
            await wait_for_async(
                lambda: sum(c.done() for c in calls) >= NUM_CALLS - held, "refusals"
            )
            gate.open()
            return Counter(await asyncio.wait_for(asyncio.gather(*calls), HANG_S))

    try:
        outcomes = h.run(main(), timeout=HANG_S + 30)
    finally:
        gate.remove()
        h.close()
    assert set(outcomes) == {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert sum(outcomes.values()) == NUM_CALLS
    assert outcomes["RESOURCE_EXHAUSTED"] >= NUM_CALLS - held, outcomes
