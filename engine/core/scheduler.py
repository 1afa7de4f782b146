"""Continuous-batching scheduler: one token budget per step, no prefill/decode phases.

Pure Python, no torch. Each request only has tokens computed (K/V in the cache) and tokens
known (prompt + output); every step hands out at most `max_num_batched_tokens` of the
difference to at most `max_num_seqs` requests:

0. Requests whose deadline has passed are ended first, whatever their state (a waiting one
   before any compute; a running one before its next step, its blocks freed).
1. Running requests first, in running (admission) order: decodes and continuing prefill
   chunks. When the KV pool can't cover one, a victim is preempted (the policy picks it,
   `engine.core.policy.victims`: FCFS the newest running request; priority the largest
   priority value, latest arrival; fair the tenant furthest above its share), its blocks
   freed and its progress reset, and the allocation retried. A victim already scheduled
   earlier in this step is un-scheduled: its tokens go back to the budget and it leaves
   this step's output.
2. Then waiting requests in policy order (`engine.core.policy.tenant_queue`: per tenant,
   the tenant picked by the policy), unless something was preempted this step (no new
   admissions under memory pressure). A prompt longer than the budget left is chunked and
   continues next step. The first allocation failure stops admission for this step; we do
   not preempt running requests to admit waiting ones for memory, under any policy (a
   high-priority arrival waits for memory like any other). A tenant at its `max_running`
   is passed over for the rest of the step. Under `deadline`, a request whose remaining
   work can no longer end before its deadline waits until the others are admitted
   (`engine.core.policy.feasibility`). With `preempt_for_fairness` (fair policies only), a
   full set of seats is the one exception: see `_swap_for_share`.

`num_computed_tokens` is advanced when `schedule()` returns (as in vLLM v1): the runner will
compute the scheduled tokens, so the next step may already schedule the token sampled from
them. During `schedule()` every `num_computed_tokens` keeps its start-of-step value, which
is what the fork rule below needs. Should a request finish before its step's results come
back (a failed step, an abort in between), the advance is rolled back before its blocks are
freed, so the KV manager never keeps blocks whose K/V may be unwritten as cached prefix.

`n > 1`: a sample with `fork_from` shares the leader's prompt blocks once the leader has
computed all but the last prompt token (as of the start of this step, since copy-on-write
copies run before the forward and can't copy K/V that is written in it), then computes only
that last token, copying the shared partial block first.

LoRA: with `max_loras` set, the running requests use at most that many distinct adapters
(see adapter_slots.py).

Speculative decoding (a `Speculator`, engine/core/spec/): a decoding running request may
be scheduled 1 + k tokens, its last one and k proposals, within the budget, the model
length and its max_tokens. Proposals never cost a preemption: when the pool cannot cover
them the request runs without them. `update_from_output` takes back the computed count of
the rejected positions and the blocks only they used (block-table truncation, no copy);
blocks are registered in the prefix cache only once full of known (accepted) tokens.

KV tier (`kv_tier`, engine/core/kv_tier): a waiting request whose prefix continues in a tier
past the pool starts its loads and waits in the "loading" state, keeping its place in the
queue but skipped until the loads are reported (`_waits_for_kv`); it then admits like any
request, its loaded blocks being ordinary prefix hits. The tier's moves go out in the
step's `SchedulerOutput` and its results come back in `RunnerOutput.kv_tier`; `_finish`
releases what a request's loads pinned, however it leaves (abort, deadline, error).

Prefill-only (embedding) requests are scheduled like any prompt (chunked, under the same
budget) but never sample: once their whole prompt is scheduled they get no more tokens,
and they finish when the runner returns their pooled vector (`RunnerOutput.pooled`),
their blocks freed in that step. Their blocks are never registered in the prefix cache.

The class comes in parts, one job to a module: this one holds the state, the running
requests' pass (point 1, preemption), finishing and deadlines; `waiting_admission.py` the
waiting queue's pass (point 2); `scheduled_step.py` turns the step into the runner's
`SchedulerOutput` (advancing progress); `step_results.py` takes the runner's results in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from engine.config import SchedulerConfig
from engine.core import admission
from engine.core.adapter_slots import count_adapters, uses_adapter
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.kv_tier.manager import KVTierManager
from engine.core.policy.deadlines import expiry_error
from engine.core.policy.overflow import pushed_out_error
from engine.core.policy.policy import SchedulingPolicy, TenantStats
from engine.core.request import Request, RequestStatus
from engine.core.scheduled_step import ScheduledStep, build_scheduler_output
from engine.core.spec.speculator import Speculator
from engine.core.step_io import KVTierReport, SchedulerOutput
from engine.core.step_results import StepResults
from engine.core.waiting_admission import WaitingAdmission
from engine.errors import EngineError

__all__ = ["Scheduler"]

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING


class Scheduler(WaitingAdmission, StepResults):
    """Decides which requests run each step and for how many tokens; owns request state.

    `running` holds requests with blocks, in admission order; `waiting` holds new and
    preempted requests in policy order. Every unfinished request is in `requests`.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        max_loras: int | None = None,
        speculator: Speculator | None = None,
        kv_tier: KVTierManager | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`max_loras`: distinct LoRA adapters the running requests may use at once (the
        runner's slots); None when LoRA is off. `speculator`: speculative decoding, or None.
        `kv_tier`: the KV tiers behind the pool (over this `kv_manager`), or None. `clock`:
        the time requests' deadlines and timestamps are on (monotonic seconds; tests pass a
        fake one)."""
        if max_model_len < 2:
            raise ValueError("max_model_len: must be >= 2 (one prompt and one output token)")
        self.config = config
        self.kv_manager = kv_manager
        self.max_model_len = max_model_len
        self.max_loras = max_loras
        self.speculator = speculator
        self.kv_tier = kv_tier
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.clock = clock
        self.policy = SchedulingPolicy(config)
        self.waiting = self.policy.queue
        self.num_preemptions = 0
        # Steps begun (`schedule()` calls): the clock requests' queueing is counted in.
        self.num_steps_started = 0
        # Requests the scheduler ended itself (a deadline passed, pushed out of a full
        # queue), with the error their caller gets, until the engine takes them.
        self._dropped: list[tuple[Request, EngineError]] = []
        # Ids the runner holds state for that finished or were aborted since the last step.
        self._left_batch: set[str] = set()
        # The last schedule's token counts until its results come back: a request finished
        # in between (failed step, abort) has its K/V possibly unwritten, see `_finish`.
        self._in_flight: dict[str, int] = {}

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def apply_kv_report(self, report: KVTierReport) -> None:
        """Takes in KV tier results that arrived between steps (the engine polls before
        `schedule`, so lookups see the freshest index and copied blocks are free again)."""
        if self.kv_tier is not None:
            self.kv_tier.apply(report)

    def has_kv_moves(self) -> bool:
        """KV tier moves not yet handed out or reported: steps must go on (empty ones if
        need be) until they settle, since held blocks return to the pool only in a step."""
        return self.kv_tier is not None and self.kv_tier.busy

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def adapter_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per LoRA adapter name: (running, waiting); the base model is left out."""
        return count_adapters(self.running), count_adapters(self.waiting)

    def uses_adapter(self, lora_name: str) -> bool:
        """True while any unfinished request runs the adapter named `lora_name`."""
        return uses_adapter(self.requests.values(), lora_name)

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request; raises if it is a duplicate, can never run, its deadline has
        passed, its tenant is at a limit, or the queue is full (the checks of
        `engine.core.admission` and the policy's). At a full queue the most over-share
        tenant's last request may be pushed out instead (`take_dropped` reports it).

        Sets `request.max_tokens` to the context left when it is None.
        """
        admission.check_new_id(request.request_id, self.requests)
        kv = self.kv_manager
        if request.prefill_only:
            admission.fit_prompt(
                request.num_prompt_tokens, self.max_model_len, kv.block_size, kv.num_blocks
            )
            request.max_tokens = 0
        else:
            request.max_tokens = admission.fit_lengths(
                request.num_prompt_tokens,
                request.max_tokens,
                self.max_model_len,
                kv.block_size,
                kv.num_blocks,
            )
        now = self.clock()
        pushed = self.policy.check_admission(request, now, self.config.max_queue_len)
        if pushed is not None:  # the queue is full: the most over-share tenant's last one
            self._drop([(pushed, pushed_out_error(pushed, self.config.max_queue_len))])
        request.status = _WAITING
        request.times.queued_step = self.num_steps_started
        self.requests[request.request_id] = request
        self.waiting.add(request)
        self.policy.admitted(request, now)

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Picks this step's requests and token counts; see the module docstring."""
        now = self.clock()
        self.num_steps_started += 1
        self._expire_deadlines(now)
        self.policy.step_started(now, bool(self.running))
        step = ScheduledStep(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step, now)
        # Charged before admission, so that admission sees this step's work in the counters.
        self.policy.charge_running(step.running, step.num_scheduled)
        if not step.preempted:
            self._schedule_waiting(step, now)
        return self._build_output(step)

    def _schedule_running(self, step: ScheduledStep, now: float) -> None:
        """The decode hot path: one allocation per running request, no sorting, no copies."""
        running = self.running
        allocate = self.kv_manager.allocate_slots
        max_len = self.max_model_len
        num_scheduled, new_block_ids, scheduled = (
            step.num_scheduled,
            step.new_block_ids,
            step.running,
        )
        budget = step.budget
        spec = self.speculator
        if spec is not None:
            spec.begin_step(len(running))
        i = 0
        while budget > 0 and i < len(running):
            req = running[i]
            computed = req.num_computed_tokens
            n = len(req.all_token_ids) - computed
            if n > budget:
                n = budget
            if computed + n > max_len:
                n = max_len - computed
            if n <= 0:  # nothing to compute until the runner answers for it
                i += 1
                continue
            blocks = None
            if spec is not None and n == 1 and len(req.all_token_ids) - computed == 1:
                blocks = self._allocate_speculative(req, budget, step)
                if blocks is not None:
                    n += len(step.spec.get(req.request_id, ()))
            if blocks is None:
                blocks = allocate(req, n)
            if blocks is None and self.kv_tier is not None and self.kv_tier.held_blocks_return():
                i += 1  # blocks held for a tier's copy are back next step: wait, not preempt
                continue
            if blocks is None:
                step.budget = budget
                blocks, i = self._preempt_until_fits(req, i, n, step, now)
                budget = step.budget
                if blocks is None:  # it was the victim itself; `i` is already the next one
                    continue
            rid = req.request_id
            num_scheduled[rid] = n
            new_block_ids[rid] = blocks
            scheduled.append(req)
            budget -= n
            i += 1
        step.budget = budget

    def _allocate_speculative(
        self, req: Request, budget: int, step: ScheduledStep
    ) -> list[int] | None:
        """Slots for a decode with proposals (and a draft model's lookahead), recorded in
        `step`; None, with nothing recorded or allocated, when there are no proposals or the
        pool cannot cover them (the caller allocates the plain decode)."""
        spec = self.speculator
        assert spec is not None
        computed = req.num_computed_tokens
        max_k = min(
            budget - 1,
            self.max_model_len - computed - 1,
            req.max_tokens - req.num_output_tokens - 1,
        )
        draft = spec.propose(req, max_k)
        ahead = spec.lookahead(req)
        if ahead:  # its KV must fit the model length too
            ahead = max(0, min(ahead, self.max_model_len - computed - 1 - len(draft)))
        if not draft and not ahead:
            return None
        blocks = self.kv_manager.allocate_slots(req, 1 + len(draft) + ahead)
        if blocks is None:
            return None
        rid = req.request_id
        if draft:
            step.spec[rid] = draft
        if ahead:
            step.lookahead[rid] = ahead
        return blocks

    def _preempt_until_fits(
        self, req: Request, i: int, n: int, step: ScheduledStep, now: float
    ) -> tuple[list[int] | None, int]:
        """Preempts victims until `req` (at `running[i]`) gets its `n` tokens' slots.

        Returns the new blocks (None if `req` itself was preempted) and `req`'s index after
        the removals. FCFS victims come from the tail, i.e. not yet scheduled this step;
        a priority or fair victim may have been, and `_preempt` un-schedules it.
        """
        while True:
            v = self._pick_victim()
            victim = self.running[v]
            self._preempt(v, step, now)
            if victim is req:
                return None, i
            if v < i:
                i -= 1
            blocks = self.kv_manager.allocate_slots(req, n)
            if blocks is not None:
                return blocks, i

    def _pick_victim(self) -> int:
        """Index in `running` of the request to preempt (the policy's choice)."""
        return self.policy.pick_victim(self.running)

    def _preempt(self, index: int, step: ScheduledStep, now: float) -> None:
        """Frees `running[index]`'s blocks, resets its progress and queues it again."""
        victim = self.running.pop(index)
        rid = victim.request_id
        n = step.num_scheduled.pop(rid, None)
        if n is not None:  # scheduled earlier in this step: take it back out
            step.budget += n
            del step.new_block_ids[rid]
            step.running.remove(victim)
            step.spec.pop(rid, None)
            step.lookahead.pop(rid, None)
        self.kv_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        victim.times.preempted.append(now)
        self.num_preemptions += 1
        step.preempted.add(rid)
        self.waiting.requeue_preempted(victim)

    def _build_output(self, step: ScheduledStep) -> SchedulerOutput:
        """The step's `SchedulerOutput` (progress advanced), with the KV tier's moves."""
        so = build_scheduler_output(
            step,
            self.kv_manager,
            self.config.max_num_batched_tokens,
            self._left_batch,
            self.speculator is not None,
        )
        self._left_batch = set()
        self._in_flight = so.num_scheduled_tokens
        if self.kv_tier is not None:
            so.kv_saves, so.kv_loads, so.kv_deletes = self.kv_tier.take_moves()
        return so

    def _finish(self, req: Request, now: float, in_batch: bool) -> None:
        """Bookkeeping for a request whose finished status is already set.

        The caller takes it out of `running` / `waiting`. `in_batch`: the runner holds state
        for it (a running request's, or a preempted one's parked seeded generator), so the
        next step reports it in `finished_req_ids`; a request that never ran is not reported.
        """
        req.times.finished = now
        # Scheduled but its results not in (a failed step, an abort in between): the K/V of
        # those tokens may never be written, so the KV manager must not keep their blocks as
        # cached prefix. (`_in_flight` is the runner's dict too: read it, never mutate it.)
        req.num_computed_tokens -= self._in_flight.get(req.request_id, 0)
        self.kv_manager.free(req)
        if self.kv_tier is not None:  # loading or not: what its loads pinned goes
            self.kv_tier.on_finished(req)
        self.policy.on_finish(req, now)
        del self.requests[req.request_id]
        if self.speculator is not None:
            self.speculator.on_finished(req)
        if in_batch:
            self._left_batch.add(req.request_id)

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus
    ) -> list[Request]:
        """Finishes requests in any state with `status` (aborts, stop strings, errors).

        Unknown or already finished ids are ignored; returns the requests finished here.
        """
        if not status.is_finished:
            raise ValueError(f"status: {status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        now = self.clock()
        done: list[Request] = []
        queued: list[Request] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            was_running = req.status is _RUNNING
            if not was_running:
                queued.append(req)
            in_batch = was_running or req.status is RequestStatus.PREEMPTED
            req.status = status
            self._finish(req, now, in_batch=in_batch)
            done.append(req)
        if queued:
            self.waiting.remove(queued)
        if len(queued) < len(done):
            self.running = [r for r in self.running if r.status is _RUNNING]
        return done

    def stop_on_string(
        self, request: Request, stop: str, num_output_tokens: int | None = None
    ) -> None:
        """Ends `request` on a stop string the detokenizer found; `stop` is its stop_reason.

        A request still held is finished here. One this step already finished by length, EOS
        or a stop token is marked stopped by the string instead: the string came first in its
        text. An aborted or failed request keeps its status. `num_output_tokens`: the output
        ends there, at the token that completed the string (several tokens accepted in one
        step may run past it); the blocks of the tokens after it go with the request's.
        """
        if num_output_tokens is not None and request.status in (
            _RUNNING,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_STOPPED,
        ):
            request.truncate_output(num_output_tokens)
        if not request.is_finished:
            self.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)
        elif request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            return
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = stop

    def abort(self, request_id: str) -> Request | None:
        """Aborts a request in any state; None if it is unknown or already finished."""
        done = self.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        return done[0] if done else None

    # ---- tenants and deadlines -------------------------------------------------------------
    def _expire_deadlines(self, now: float) -> None:
        """Ends every request whose deadline has passed, before this step computes anything.

        Whatever its state: a waiting (or preempted) request was never given this step, a
        running one is aborted and its blocks freed now (`finish_requests` -> `_finish`),
        and the runner drops it with this step's `finished_req_ids`. A state added later
        that holds more than blocks (a request waiting on a KV-tier load) is released in
        `_finish` as well, so expiring it here needs nothing more.
        """
        expired = self.policy.expired(now, self.requests)
        if expired:
            self._drop([(r, expiry_error(r, now)) for r in expired])

    def _drop(self, dropped: list[tuple[Request, EngineError]]) -> None:
        """Ends each request with the error its caller gets (`take_dropped`)."""
        self.finish_requests([r.request_id for r, _ in dropped], RequestStatus.FINISHED_ERROR)
        self._dropped += dropped

    def take_dropped(self) -> list[tuple[Request, EngineError]]:
        """Requests the scheduler ended itself since the last call, each with the error its
        caller must get (deadline passed: `DeadlineExceededError`; pushed out of a full
        queue: `QueueFullError`). The engine fails their whole groups."""
        out, self._dropped = self._dropped, []
        return out

    def tenant_stats(self) -> dict[str, TenantStats]:
        """Requests running and waiting, and virtual token counters, per tenant."""
        return self.policy.tenant_stats(self.running)
