"""The tensor-parallel step transport: the flat encoding and the shared-memory ring.

Both ends run in this process (the ring is shared memory and a semaphore; threads stand in
for the worker), so the tests pin the protocol without starting a process.
"""

from __future__ import annotations

import multiprocessing
import threading
from dataclasses import replace

import pytest

from engine.core.step_io import CachedRequestData, KVMove, NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker.distributed.transport import (
    STOP,
    StepReader,
    StepWriter,
    decode_step,
    encode_step,
)
from tests.support.waiting import HANG_S


def _step() -> SchedulerOutput:
    new = NewRequestData("a", [1, 2, 3], [9], SamplingParams(seed=4), [0, 1], 2, grammar="G")
    cached = [CachedRequestData("b", [7], [(0, 5)], 12, 3), CachedRequestData("c", [], [], 3)]
    return SchedulerOutput(
        [new], cached, {"a": 2, "b": 3, "c": 1}, 6, {"d"}, {"d"}, [(5, 6)],
        spec_token_ids={"b": [4, 5]}, num_lookahead_tokens={"b": 2},
        kv_saves=[KVMove(b"h1", 8, 2, True), KVMove(b"h2", 9, to_disk=True)],
        kv_loads=[KVMove(b"h3", 10)], kv_deletes=[b"h4"],
    )  # fmt: skip


def test_a_step_round_trips_without_its_grammar_and_with_the_sampled_tokens() -> None:
    """Proposals (and the kept blocks after a rejection) and the KV tier's moves (every
    rank saves and loads its share of the blocks) reach every rank in the message."""
    so = _step()
    msg = decode_step(encode_step(so, ["b", "c"], [[11], [12, 13]]))
    assert msg.so == replace(
        so, scheduled_new_reqs=[replace(so.scheduled_new_reqs[0], grammar=None)]
    )
    assert (msg.sampled_req_ids, msg.sampled_token_ids) == (["b", "c"], [[11], [12, 13]])
    assert msg.so.spec_token_ids == {"b": [4, 5]} and msg.so.scheduled_cached_reqs[0] == (
        CachedRequestData("b", [7], [(0, 5)], 12, 3)
    )
    assert msg.so.kv_saves[0] == KVMove(b"h1", 8, 2, True) and len(msg.so.kv_saves) == 2
    assert so.scheduled_new_reqs[0].grammar == "G"  # the engine's own object is untouched


@pytest.fixture()
def ring():
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    writer = StepWriter(ctx, ours, slots=4, slot_bytes=64)
    reader = StepReader(writer.handle, theirs)
    yield writer, reader
    reader.close()
    writer.close()


def test_messages_arrive_in_order_across_wrap_arounds_and_past_the_slot_size(ring) -> None:
    writer, reader = ring
    sent = [bytes([i]) * (10 if i % 3 else 500) for i in range(1, 14)]  # 500 B: on the pipe
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.extend(reader.recv() for _ in sent))
    t.start()
    for data in sent:
        writer.send(data, timeout_s=HANG_S)
    t.join(HANG_S)
    assert got == sent


def test_a_full_ring_waits_for_the_reader_then_times_out(ring) -> None:
    writer, reader = ring
    for i in range(4):
        writer.send(bytes([i]), timeout_s=HANG_S)  # the reader is 4 behind: the ring is full
    with pytest.raises(TimeoutError):
        writer.send(b"x", timeout_s=0.01)
    assert reader.recv() == bytes([0])
    writer.send(STOP, timeout_s=HANG_S)  # a slot came free
    assert [reader.recv() for _ in range(4)] == [bytes([1]), bytes([2]), bytes([3]), STOP]
