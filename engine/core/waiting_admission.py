"""Admission from the waiting queue: the second half of a scheduling step.

`WaitingAdmission` is a part of `Scheduler` (engine/core/scheduler.py, whose docstring
states the rules, point 2), kept in its own module because it is a job of its own: walking
the waiting queue in policy order and moving requests to running with their first chunk
(a prefix-cache lookup, or a fork sample sharing its leader's prompt blocks), passing over
those that must wait (a tenant at its seat limit, an adapter without a slot, a fork whose
leader is not far enough, a prefix being loaded from a KV tier, a late request under
`deadline`) and, with `preempt_for_fairness`, swapping a seat from an over-share tenant.
It reads and changes the scheduler's state, declared below; the scheduler owns it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.core.adapter_slots import AdapterSlots
from engine.core.policy.tenant_slots import TenantSlots, share_victim
from engine.core.request import Request, RequestStatus
from engine.core.scheduled_step import ScheduledStep

if TYPE_CHECKING:
    from engine.config import SchedulerConfig
    from engine.core.kv_cache.manager import KVCacheManager
    from engine.core.kv_tier.manager import KVTierManager
    from engine.core.policy.policy import SchedulingPolicy
    from engine.core.policy.tenant_queue import TenantQueue

__all__ = ["WaitingAdmission"]

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING


class WaitingAdmission:
    """The scheduler's admission of waiting requests (a mixin of `Scheduler`)."""

    # The scheduler's state this part reads and changes (set in `Scheduler.__init__`).
    config: SchedulerConfig
    kv_manager: KVCacheManager
    kv_tier: KVTierManager | None
    max_model_len: int
    max_loras: int | None
    policy: SchedulingPolicy
    requests: dict[str, Request]
    running: list[Request]
    waiting: TenantQueue
    num_steps_started: int
    _preempt: Callable[[int, ScheduledStep, float], None]

    def _schedule_waiting(self, step: ScheduledStep, now: float) -> None:
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
        step: ScheduledStep,
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
        step: ScheduledStep,
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
        self, step: ScheduledStep, now: float, adapters: AdapterSlots, tenants: TenantSlots
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
