"""Each step's SchedulerOutput, from rank 0 to the workers: flat bytes in a shared-memory ring.

A worker runs the same `ModelRunner.execute` as rank 0 on the same SchedulerOutput, so its
per-request state (token ids, block tables) follows rank 0's exactly. The one thing it
cannot see is what rank 0 sampled (workers do not sample), so each message also carries the
tokens rank 0 appended in the previous step; the worker appends them before the step runs.

Encoding: the message is flattened to plain lists before pickling. For a decode step of 256
requests, pickling the dataclasses took ~250 µs to dump and ~210 µs to load, the flat form
~45 and ~65 µs. Compiled grammars do not cross (workers never sample, and llguidance
matchers do not pickle).

Transport: per worker, a ring of `RING_SLOTS` slots in shared memory and a semaphore that
counts the messages in it. `bench/tp_transport.py` measured the whole per-step cost (send,
wake-up, decode, up to the step's first collective) of a multiprocessing pipe, this ring, and
torch.distributed's broadcast_object_list. The ring was at or below the pipe in 7 of 8
(message, run) pairs, by 1-49 µs per step (a 4x512 prefill step once 12 µs under, once 29
µs over), and 3-24x under the broadcast; flattening the message mattered more (1.2-3x). The
table is in docs/scaling.md. A message larger than a slot (a step admitting very long
prompts) goes over the worker's pipe, its slot saying so.
The writer never waits unless the worker is `RING_SLOTS` messages behind; rank 0 cannot run
ahead that far in practice, since every step with tokens ends in collectives both ranks
join, and the wait is bounded by the parallel timeout and ends when the pool fails.

A zero-length message is the order to stop.
"""

from __future__ import annotations

import dataclasses
import pickle
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from engine.core.step_io import CachedRequestData, KVMove, SchedulerOutput

STOP = b""
RING_SLOTS = 8
SLOT_BYTES = 256 * 1024
_HEADER = 64  # bytes 0..7: messages the reader has consumed (written by the reader only)
_LEN = struct.Struct("<q")  # a slot's first 8 bytes: payload length, or -1: on the pipe
_WRITER_POLL_S = 50e-6


@dataclass
class StepMessage:
    so: SchedulerOutput
    # What rank 0 sampled in the step before `so`: request ids and their new tokens (one,
    # or several when proposals were accepted).
    sampled_req_ids: list[str]
    sampled_token_ids: list[list[int]]


def encode_step(so: SchedulerOutput, sampled_req_ids: list[str], sampled: list[list[int]]) -> bytes:
    cached = so.scheduled_cached_reqs
    new = [
        r if r.grammar is None else dataclasses.replace(r, grammar=None)
        for r in so.scheduled_new_reqs
    ]
    payload = (
        new,
        [c.request_id for c in cached],
        [c.new_block_ids for c in cached],
        [c.replaced_block_ids for c in cached],
        [c.num_computed_tokens for c in cached],
        [c.num_blocks_kept for c in cached],
        so.num_scheduled_tokens,
        so.total_num_scheduled_tokens,
        so.finished_req_ids,
        so.preempted_req_ids,
        so.block_copies,
        so.spec_token_ids,
        so.num_lookahead_tokens,
        [_move_row(m) for m in so.kv_saves],
        [_move_row(m) for m in so.kv_loads],
        so.kv_deletes,
        sampled_req_ids,
        sampled,
    )
    return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def decode_step(data: bytes) -> StepMessage:
    (
        new, ids, new_blocks, replaced, computed, kept, scheduled, total, finished, preempted,
        copies, spec, lookahead, saves, loads, deletes, sampled_ids, sampled,
    ) = pickle.loads(data)  # fmt: skip
    cached = [
        CachedRequestData(*row)
        for row in zip(ids, new_blocks, replaced, computed, kept, strict=True)
    ]
    so = SchedulerOutput(
        new, cached, scheduled, total, finished, preempted, copies, spec, lookahead,
        kv_saves=[KVMove(*row) for row in saves], kv_loads=[KVMove(*row) for row in loads],
        kv_deletes=deletes,
    )  # fmt: skip
    return StepMessage(so, sampled_ids, sampled)


def _move_row(m: KVMove) -> tuple[bytes, int, int, bool]:
    """A KV tier move as a plain tuple: every rank carries out the same moves on its share
    of the blocks (engine/worker/kv_tier/tp_tier_worker.py)."""
    return (m.block_hash, m.block_id, m.host_slot, m.to_disk)


@dataclass(frozen=True)
class RingHandle:
    """What a worker needs to read its ring; picklable while the worker is being spawned."""

    shm_name: str
    semaphore: Any  # multiprocessing Semaphore: messages written and not yet read
    slots: int
    slot_bytes: int


class StepWriter:
    """Rank 0's end of one worker's ring (single writer). `close` frees the memory."""

    def __init__(self, ctx: Any, conn: Connection, slots: int = RING_SLOTS,
                 slot_bytes: int = SLOT_BYTES):  # fmt: skip
        self._shm = SharedMemory(create=True, size=_HEADER + slots * slot_bytes)
        _LEN.pack_into(self._shm.buf, 0, 0)
        self.handle = RingHandle(self._shm.name, ctx.Semaphore(0), slots, slot_bytes)
        self._conn = conn
        self._written = 0

    def send(
        self, data: bytes, timeout_s: float, abandon: Callable[[], bool] = lambda: False
    ) -> None:
        """Puts one message in the ring (or on the pipe when larger than a slot) and wakes
        the worker. TimeoutError when the worker has left the ring full for `timeout_s`, or
        as soon as `abandon()` says the worker is gone."""
        h = self.handle
        deadline = None
        while self._written - _LEN.unpack_from(self._shm.buf, 0)[0] >= h.slots:
            deadline = deadline or time.monotonic() + timeout_s
            if time.monotonic() > deadline or abandon():
                raise TimeoutError(f"the worker left {h.slots} step messages unread")
            time.sleep(_WRITER_POLL_S)
        offset = _HEADER + (self._written % h.slots) * h.slot_bytes
        on_pipe = len(data) > h.slot_bytes - _LEN.size
        _LEN.pack_into(self._shm.buf, offset, -1 if on_pipe else len(data))
        if not on_pipe:
            self._shm.buf[offset + _LEN.size : offset + _LEN.size + len(data)] = data
        self._written += 1
        h.semaphore.release()  # a syscall: the slot's bytes are visible before the wake-up
        if on_pipe:  # after the release: the worker reads it as it is written
            self._conn.send_bytes(data)

    def close(self) -> None:
        self._shm.close()
        self._shm.unlink()


class StepReader:
    """A worker's end of its ring (single reader)."""

    def __init__(self, handle: RingHandle, conn: Connection):
        self._h = handle
        self._shm = SharedMemory(name=handle.shm_name)
        self._conn = conn
        self._read = 0

    def recv(self) -> bytes:
        """The next message, waiting for it (rank 0's death ends the process meanwhile)."""
        h = self._h
        h.semaphore.acquire()
        offset = _HEADER + (self._read % h.slots) * h.slot_bytes
        (n,) = _LEN.unpack_from(self._shm.buf, offset)
        if n < 0:
            data = self._conn.recv_bytes()
        else:
            data = bytes(self._shm.buf[offset + _LEN.size : offset + _LEN.size + n])
        self._read += 1
        _LEN.pack_into(self._shm.buf, 0, self._read)  # the slot may be reused
        return data

    def close(self) -> None:
        self._shm.close()
