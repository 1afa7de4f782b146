"""One scheduling step in the making (`ScheduledStep`) and the `SchedulerOutput` it becomes.

The scheduler fills a `ScheduledStep` as it hands out the step's token budget (running
requests first, then admissions from the waiting queue); `build_scheduler_output` turns it
into the runner's message and advances every scheduled request's progress, which is the
point where a step is committed (engine/core/scheduler.py explains why the advance happens
there and how it is rolled back when the results never come). Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.kv_cache.manager import KVCacheManager
from engine.core.request import Request
from engine.core.step_io import CachedRequestData, NewRequestData, SchedulerOutput

__all__ = ["ScheduledStep", "build_scheduler_output"]


@dataclass(slots=True)
class ScheduledStep:
    """What one `schedule()` call has handed out so far (a per-step context, not state)."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    # Running requests scheduled this step, in order, and the blocks each got appended.
    running: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests admitted from the waiting queue, with their computed tokens before this step.
    admitted: list[tuple[Request, int]] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    # Speculative decoding: proposals scheduled, and a draft model's lookahead, per request.
    spec: dict[str, list[int]] = field(default_factory=dict)
    lookahead: dict[str, int] = field(default_factory=dict)


def build_scheduler_output(
    step: ScheduledStep,
    kv: KVCacheManager,
    max_num_batched_tokens: int,
    left_batch: set[str],
    speculating: bool,
) -> SchedulerOutput:
    """Turns the step into the runner's `SchedulerOutput`, then advances progress: each
    scheduled request's `num_computed_tokens` moves past the tokens it was given.

    `left_batch`: ids the runner holds state for that finished or were aborted since the
    last step (reported with the step's preempted ones in `finished_req_ids`).
    `speculating`: a speculator is on, so each running request's entry carries the blocks
    it held before this step's (the runner truncates its table to them on rejections).
    The caller adds the KV tier's moves."""
    copies = kv.take_block_copies()
    if copies and step.preempted:  # a victim's copies target blocks it no longer holds
        copies = [c for c in copies if c.request_id not in step.preempted]
    replaced: dict[str, list[tuple[int, int]]] = {}
    for c in copies:
        replaced.setdefault(c.request_id, []).append((c.index, c.dst))
    num_scheduled = step.num_scheduled
    cached_reqs = []
    for req in step.running:
        rid = req.request_id
        new_ids = step.new_block_ids[rid]
        cached_reqs.append(
            CachedRequestData(
                rid, new_ids, replaced.get(rid, []), req.num_computed_tokens,
                kv.num_blocks_held(rid) - len(new_ids) if speculating else None,
            )
        )  # fmt: skip
        req.num_computed_tokens += num_scheduled[rid]
    new_reqs = []
    for req, start in step.admitted:
        rid = req.request_id
        new_reqs.append(
            NewRequestData(
                rid,
                req.prompt_token_ids,
                list(req.output_token_ids),
                req.sampling_params,
                kv.get_block_ids(rid),
                start,
                req.grammar,
                req.lora,
                req.pooling_params,
            )
        )
        req.num_computed_tokens = start + num_scheduled[rid]
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached_reqs,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=max_num_batched_tokens - step.budget,
        finished_req_ids=left_batch | step.preempted,
        preempted_req_ids=step.preempted,
        block_copies=[(c.src, c.dst) for c in copies],
        spec_token_ids=step.spec,
        num_lookahead_tokens=step.lookahead,
    )
