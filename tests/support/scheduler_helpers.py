"""Shared helpers for the scheduler tests (`tests/core/test_scheduler*.py`): requests with
unique prompts, a scheduler over a real KV cache manager, and a fake runner step.

Block ids: the pool hands out 0, 1, 2, ... from the head of its free queue; `free` returns a
request's blocks tail first to the tail of the queue. Most tests use block_size 4.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from engine.config import SchedulerConfig
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.policy.tenant import Tenant
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.spec.speculator import Speculator
from engine.core.step_io import RunnerOutput, SchedulerOutput
from engine.sampling_params import SamplingParams

SAMPLED = 7  # the fake runner samples this token for every request


def make_request(
    request_id: str,
    prompt: int | list[int] = 8,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival: float | None = None,
    *,
    eos: int | None = None,
    fork_from: str | None = None,
    tenant: Tenant | None = None,
    deadline: float | None = None,
    **params,
) -> Request:
    """A request whose prompt is `prompt` tokens unique to its id (no accidental prefix hits),
    or the given token list."""
    if isinstance(prompt, int):
        base = 1000 + (zlib.crc32(request_id.encode()) % 100_000) * 1000
        prompt = list(range(base, base + prompt))
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(
        request_id,
        prompt,
        sp,
        eos_token_ids=frozenset() if eos is None else frozenset({eos}),
        arrival_time=arrival,
        priority=priority,
        fork_from=fork_from,
        tenant=tenant,
        deadline=deadline,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    policy: str = "fcfs",
    max_model_len: int = 256,
    max_queue_len: int = 64,
    prefix_caching: bool = True,
    speculator: Speculator | None = None,
    clock: Callable[[], float] | None = None,
    **config,
) -> Scheduler:
    """`config`: further SchedulerConfig fields (charge weights, preempt_for_fairness);
    `clock`: the scheduler's clock (a `FakeClock` for deadlines and token rates)."""
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=policy,
        max_queue_len=max_queue_len,
        **config,
    )
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(
        cfg, kv, max_model_len, speculator=speculator, **({} if clock is None else {"clock": clock})
    )


class FakeClock:
    """A scheduler clock that moves only when the test says (`advance`)."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fake_runner_output(
    sched: Scheduler, so: SchedulerOutput, token: int | dict[str, int] = SAMPLED
) -> RunnerOutput:
    """Samples `token` for every scheduled request whose known tokens are all computed."""
    ids = []
    for rid in so.num_scheduled_tokens:
        req = sched.get_request(rid)
        if req is not None and req.num_computed_tokens == req.num_tokens:
            ids.append(rid)
    toks = [[token[r] if isinstance(token, dict) else token] for r in ids]
    return RunnerOutput(req_ids=ids, sampled_token_ids=toks)


def step(
    sched: Scheduler, token: int | dict[str, int] = SAMPLED
) -> tuple[SchedulerOutput, list[Request]]:
    so = sched.schedule()
    return so, sched.update_from_output(so, fake_runner_output(sched, so, token))


def block_ids(sched: Scheduler, rid: str) -> list[int]:
    return sched.kv_manager.get_block_ids(rid)


def step_after_add(sched: Scheduler, req: Request) -> tuple[SchedulerOutput, list[Request]]:
    sched.add_request(req)
    return step(sched)


def two_full_requests(policy: str = "fcfs") -> tuple[Scheduler, Request, Request]:
    """4 blocks of 4: a and b each prefill 8 tokens (2 blocks) and sample once."""
    sched = make_scheduler(num_blocks=4, policy=policy)
    a = make_request("a", 8, max_tokens=3, arrival=0.0)
    b = make_request("b", 8, max_tokens=8, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert block_ids(sched, "a") == [0, 1] and block_ids(sched, "b") == [2, 3]
    return sched, a, b
