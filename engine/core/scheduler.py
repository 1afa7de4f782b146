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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.core import admission
from engine.core.adapter_slots import AdapterSlots, count_adapters, uses_adapter
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.kv_tier.manager import KVTierManager
from engine.core.policy.deadlines import expiry_error
from engine.core.policy.overflow import pushed_out_error
from engine.core.policy.policy import SchedulingPolicy, TenantStats
from engine.core.policy.tenant_slots import TenantSlots, share_victim
from engine.core.request import Request, RequestStatus
from engine.core.spec.speculator import Speculator
from engine.core.step_io import (
    CachedRequestData,
    KVTierReport,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
)
from engine.core.stop import check_stop
from engine.errors import EngineError

__all__ = ["Scheduler"]

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING


@dataclass(slots=True)
class _Step:
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


class Scheduler:
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
        step = _Step(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step, now)
        # Charged before admission, so that admission sees this step's work in the counters.
        self.policy.charge_running(step.running, step.num_scheduled)
        if not step.preempted:
            self._schedule_waiting(step, now)
        return self._build_output(step)

    def _schedule_running(self, step: _Step, now: float) -> None:
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

    def _allocate_speculative(self, req: Request, budget: int, step: _Step) -> list[int] | None:
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
        self, req: Request, i: int, n: int, step: _Step, now: float
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

    def _preempt(self, index: int, step: _Step, now: float) -> None:
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

    def _schedule_waiting(self, step: _Step, now: float) -> None:
        """Admits waiting requests in policy order until budget, seats or blocks run out.

        A fork sample whose leader is running but not far enough is skipped (it keeps its
        place) without blocking the requests behind it. Under `deadline`, a request that can
        no longer make its deadline (`policy.feasibility`) is set aside the same way and
        admitted in a second pass only if seats and budget remain once the rest is taken.
        """
        waiting, running = self.waiting, self.running
        skipped: list[Request] = []
        late: list[Request] | None = [] if self.policy.defers_late else None
        adapters = AdapterSlots(self.max_loras, running)
        tenants = TenantSlots(running, self.config.max_num_seqs)
        waiting.offer_shares(tenants)
        pool_full = self._admit_waiting(step, now, adapters, tenants, skipped, late)
        if late:
            waiting.restore(late)
            if not pool_full:
                self._admit_waiting(step, now, adapters, tenants, skipped, None)
        max_seqs = self.config.max_num_seqs
        if self.policy.preempt_for_share and waiting and len(running) >= max_seqs:
            self._swap_for_share(step, now, adapters, tenants)
        waiting.unpark_all()
        if skipped:
            waiting.restore(skipped)

    def _admit_waiting(
        self,
        step: _Step,
        now: float,
        adapters: AdapterSlots,
        tenants: TenantSlots,
        skipped: list[Request],
        late: list[Request] | None,
    ) -> bool:
        """One pass of `_schedule_waiting`; sets aside in `late` (when given) the requests
        that cannot make their deadline. True when it stopped because the pool was full."""
        waiting, running = self.waiting, self.running
        max_seqs = self.config.max_num_seqs
        is_late = self.policy.is_late
        while waiting and step.budget > 0 and len(running) < max_seqs:
            req = waiting.peek()
            if not tenants.admits(req):  # its tenant is at max_running: pass it over
                waiting.park(req.tenant.name)
                continue
            if late is not None and is_late(req, now):
                late.append(waiting.pop())
                continue
            leader = self._fork_leader(req)
            if (
                leader is False
                or not adapters.admits(req)
                or (leader is None and self._waits_for_kv(req))
            ):
                skipped.append(waiting.pop())
                continue
            if not self._admit(req, leader, step, now, adapters, tenants):
                return True  # the pool can't cover it: stop admitting this step
        return False

    def _admit(
        self,
        req: Request,
        leader: Request | None,
        step: _Step,
        now: float,
        adapters: AdapterSlots,
        tenants: TenantSlots,
    ) -> bool:
        """Moves the head of the queue, `req`, to running with its first chunk; False (and
        nothing changed) when the pool can't cover the chunk."""
        if leader is None:
            start, n = self._allocate_new(req, step.budget)
        else:
            start, n = self._allocate_fork(req, leader, step.budget)
        if n == 0:
            return False
        self.waiting.pop()
        self.running.append(req)
        adapters.add(req)
        tenants.added(req)
        req.status = _RUNNING
        if req.times.first_scheduled is None:
            req.times.first_scheduled = now
            req.times.first_scheduled_step = self.num_steps_started
            req.num_cached_tokens = start
        step.num_scheduled[req.request_id] = n
        step.admitted.append((req, start))
        step.budget -= n
        self.policy.charge_admitted(req, start, n)
        return True

    def _swap_for_share(
        self, step: _Step, now: float, adapters: AdapterSlots, tenants: TenantSlots
    ) -> None:
        """Every seat is held (`preempt_for_fairness`, fair policies): while the head of the
        queue's tenant runs fewer than its weighted share of the seats and another tenant
        runs more than its share and has been served more, preempts that tenant's last
        request (`policy.tenant_slots.share_victim`) and admits the head in its seat. The
        victim is recomputed later (mostly from the prefix cache: its blocks stay cached
        until evicted); without this, the head waits for the next seat to free, which under
        a flood of long requests can take a whole request's time. The head swaps only once
        it has waited `preempt_for_fairness_wait_steps` steps: a seat that frees by itself
        in the meantime costs no recompute (under a flood seats free every step or two).
        """
        waiting, counter = self.waiting, self.policy.counter
        assert counter is not None
        wait = self.config.preempt_for_fairness_wait_steps
        keep = {r.request_id for r, _ in step.admitted}
        while waiting and step.budget > 0:
            req = waiting.peek()
            if not tenants.admits(req) or req.fork_from is not None or not adapters.admits(req):
                return
            if self.num_steps_started - (req.times.queued_step or 0) <= wait:
                return  # it waits this many steps for a seat that frees by itself first
            v = share_victim(
                req, self.running, tenants, tenants.weights(waiting.backlog()), counter, keep
            )
            if v is None:
                return
            victim = self.running[v]
            self._preempt(v, step, now)
            tenants.removed(victim)
            if not self._admit(req, None, step, now, adapters, tenants):
                return
            keep.add(req.request_id)

    def _fork_leader(self, req: Request) -> Request | None | bool:
        """For a fork sample: the leader to share with, False to wait for it, None for no fork.

        The leader qualifies once it is running and had computed all but the last prompt
        token when this step started (`num_computed_tokens` is not advanced until the end of
        `schedule()`, so a leader admitted earlier in this call still reads as 0). A leader
        that is gone or preempted means an ordinary prefill (the prefix cache still helps).
        """
        if req.fork_from is None or req.num_prompt_tokens < 2:
            return None
        leader = self.requests.get(req.fork_from)
        if leader is None or leader.prompt_token_ids != req.prompt_token_ids:
            return None
        if leader.status is _RUNNING:
            return leader if leader.num_computed_tokens >= req.num_prompt_tokens - 1 else False
        # Not started yet: it is ahead in the queue or will be soon; share with it then.
        return False if leader.status is _WAITING else None

    def _waits_for_kv(self, req: Request) -> bool:
        """True while `req` is in the loading state: its loads are in flight, or its prefix
        continues in a KV tier and they start now."""
        tier = self.kv_tier
        return tier is not None and (tier.is_loading(req) or tier.try_load(req))

    def _cap(self, req: Request, start: int, budget: int) -> int:
        """Tokens to schedule for `req` from `start`, within the budget and the model length."""
        return min(req.num_tokens - start, budget, self.max_model_len - start)

    def _allocate_new(self, req: Request, budget: int) -> tuple[int, int]:
        """Prefix-cache lookup then slots for the next chunk: (tokens cached, tokens to run).

        Returns n == 0 when the pool can't cover the chunk. Only a lookup that admits the
        request is counted, so a head of queue blocked for many steps counts once.
        """
        kv = self.kv_manager
        cached_blocks, num_cached = kv.get_computed_blocks(req)
        n = self._cap(req, num_cached, budget)
        if kv.allocate_slots(req, n, cached_blocks or None) is None:
            return num_cached, 0
        from_tier = 0 if self.kv_tier is None else self.kv_tier.on_admitted(req, num_cached)
        kv.count_prefix_query(req, num_cached - from_tier)
        return num_cached, n

    def _allocate_fork(self, req: Request, leader: Request, budget: int) -> tuple[int, int]:
        """Shares the leader's first prompt_len - 1 tokens' blocks, then slots for the rest.

        The first allocation copies-on-write the shared partial block; on failure the fork is
        undone so the request waits with nothing held.
        """
        kv, shared = self.kv_manager, req.num_prompt_tokens - 1
        kv.fork(leader, req, shared)
        req.num_computed_tokens = shared
        n = self._cap(req, shared, budget)
        if kv.allocate_slots(req, n) is None:
            kv.free(req)
            req.num_computed_tokens = 0
            return shared, 0
        return shared, n

    def _build_output(self, step: _Step) -> SchedulerOutput:
        """Turns the step into the runner's `SchedulerOutput`, then advances progress."""
        kv = self.kv_manager
        copies = kv.take_block_copies()
        if copies and step.preempted:  # a victim's copies target blocks it no longer holds
            copies = [c for c in copies if c.request_id not in step.preempted]
        replaced: dict[str, list[tuple[int, int]]] = {}
        for c in copies:
            replaced.setdefault(c.request_id, []).append((c.index, c.dst))
        num_scheduled = step.num_scheduled
        cached_reqs = []
        speculating = self.speculator is not None
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
        finished = self._left_batch | step.preempted
        self._left_batch = set()
        self._in_flight = num_scheduled
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            finished_req_ids=finished,
            preempted_req_ids=step.preempted,
            block_copies=[(c.src, c.dst) for c in copies],
            spec_token_ids=step.spec,
            num_lookahead_tokens=step.lookahead,
        )
        if self.kv_tier is not None:
            so.kv_saves, so.kv_loads, so.kv_deletes = self.kv_tier.take_moves()
        return so

    # ---- results ---------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[Request]:
        """Appends sampled tokens, applies stop conditions, frees finished requests.

        Returns every request that got tokens this step (finished ones included). Tokens for
        requests no longer running (aborted or finished meanwhile) are dropped, and so is the
        token sampled at the end of a `max_tokens=0` request's prompt: it finishes with
        FINISHED_LENGTH and no output as soon as its whole prompt is computed.
        """
        now = self.clock()
        self._in_flight = {}
        if runner_output.kv_tier is not None and self.kv_tier is not None:
            self.kv_tier.apply(runner_output.kv_tier)
        requests, max_len = self.requests, self.max_model_len
        updated: list[Request] = []
        any_finished = False
        spec_ids = scheduler_output.spec_token_ids
        for rid, token_ids in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, strict=True
        ):
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING or not token_ids:
                continue
            draft = spec_ids.get(rid) if spec_ids else None
            if draft is not None:
                self._settle_speculation(req, draft, token_ids)
            if req.max_tokens == 0:  # prompt scoring: its prefill is done, the sample dropped
                req.status = RequestStatus.FINISHED_LENGTH
                stopped = True
            elif len(token_ids) == 1:  # the usual case: no per-token slicing
                req.append_output_token_ids(token_ids)
                stopped = check_stop(req, token_ids[0], max_len)
            else:
                stopped = self._append_until_stop(req, token_ids)
            if stopped:
                self._finish(req, now, in_batch=True)
                any_finished = True
            elif draft is not None or rid in scheduler_output.num_lookahead_tokens:
                self.kv_manager.truncate(req, req.num_computed_tokens)
            times = req.times
            if times.first_token is None:
                times.first_token = now
                times.first_token_step = self.num_steps_started
            times.last_token = now
            updated.append(req)
        if runner_output.pooled:
            any_finished |= self._finish_pooled(runner_output.pooled, now, updated)
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        if runner_output.draft_token_ids and self.speculator is not None:
            self.speculator.take_worker_proposals(requests, runner_output.draft_token_ids)
        return updated

    def _settle_speculation(self, req: Request, draft: list[int], token_ids: list[int]) -> None:
        """`req` ran 1 + len(draft) tokens and got `token_ids` back: the K/V of the first
        len(token_ids) positions (its last token and the accepted proposals) stand; the
        rejected positions are computed again as the tokens that replace them arrive."""
        req.num_computed_tokens -= 1 + len(draft) - len(token_ids)
        assert self.speculator is not None
        self.speculator.settle(req, len(draft), len(token_ids))

    def _finish_pooled(self, pooled: dict[str, list[float]], now: float, updated: list) -> bool:
        """Finishes the prefill-only requests whose vector came back (stopped: the prompt
        is all they had); appends them to `updated`. True if any finished."""
        done = False
        for rid in pooled:
            req = self.requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue  # aborted meanwhile: its vector is dropped
            req.status = RequestStatus.FINISHED_STOPPED
            self._finish(req, now, in_batch=True)
            updated.append(req)
            done = True
        return done

    def _append_until_stop(self, req: Request, token_ids: list[int]) -> bool:
        """Appends several tokens (speculative decoding), dropping any after a stop."""
        for i, tok in enumerate(token_ids):
            req.append_output_token_ids(token_ids[i : i + 1])
            if check_stop(req, tok, self.max_model_len):
                return True
        return False

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
