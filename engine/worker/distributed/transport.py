"""Each step's SchedulerOutput, from rank 0 to the workers: one pickled message over a pipe.

A worker runs the same `ModelRunner.execute` as rank 0 on the same SchedulerOutput, so its
per-request state (token ids, block tables) follows rank 0's exactly. The one thing it
cannot see is what rank 0 sampled (workers do not sample), so each message also carries the
tokens rank 0 appended in the previous step; the worker appends them before the step runs.

The message is flattened to plain lists before pickling: for a decode step of 256 requests
pickling the dataclasses took ~250 µs to dump and ~210 µs to load, the flat form ~45 and
~65 µs (bench/tp_transport.py also compares the transports: a pipe, shared memory with a
semaphore, and torch.distributed's broadcast_object_list). Compiled grammars do not cross
(workers never sample, and llguidance matchers do not pickle).

A zero-length message is the order to stop.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass

from engine.core.step_io import CachedRequestData, SchedulerOutput

STOP = b""


@dataclass
class StepMessage:
    so: SchedulerOutput
    # What rank 0 sampled in the step before `so`: request ids and their new token.
    sampled_req_ids: list[str]
    sampled_token_ids: list[int]


def encode_step(so: SchedulerOutput, sampled_req_ids: list[str], sampled: list[int]) -> bytes:
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
        so.num_scheduled_tokens,
        so.total_num_scheduled_tokens,
        so.finished_req_ids,
        so.preempted_req_ids,
        so.block_copies,
        sampled_req_ids,
        sampled,
    )
    return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def decode_step(data: bytes) -> StepMessage:
    (
        new, ids, new_blocks, replaced, computed, scheduled, total, finished, preempted,
        copies, sampled_ids, sampled,
    ) = pickle.loads(data)  # fmt: skip
    cached = [
        CachedRequestData(*row) for row in zip(ids, new_blocks, replaced, computed, strict=True)
    ]
    so = SchedulerOutput(new, cached, scheduled, total, finished, preempted, copies)
    return StepMessage(so, sampled_ids, sampled)
