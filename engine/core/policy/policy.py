"""`SchedulingPolicy`: everything the scheduler asks of its policy, for one scheduler.

`scheduler.policy` names it: `fcfs` (arrival order), `priority` (priority, then arrival),
`fair` (fair share by tenant, `fair_share`; priority then arrival within a tenant),
`deadline` (fair share by tenant, earliest deadline first within a tenant), or `auto`,
which the appliance resolves (`fair` when `server.tenants` is configured, else `fcfs`) and
which means `fcfs` to an engine built directly. Every policy honours per-request deadlines
and the per-tenant limits (`max_running`, `max_queued`, `tokens_per_minute`); only the fair
ones keep counters (`fcfs` and `priority` charge nothing and cost nothing extra).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.core import admission
from engine.core.policy.charges import ChargeRules
from engine.core.policy.deadlines import DeadlineHeap
from engine.core.policy.fair_share import VirtualTokenCounter
from engine.core.policy.feasibility import StepTimer, is_late
from engine.core.policy.overflow import overflow_victim
from engine.core.policy.tenant import DEFAULT_TENANT_NAME
from engine.core.policy.tenant_queue import TenantQueue
from engine.core.policy.token_rate import TokenRateLimiter
from engine.core.policy.victims import pick_victim
from engine.core.request import Request

FAIR_POLICIES = ("fair", "deadline")


def resolve_policy(name: str) -> str:
    """The policy an engine runs for `scheduler.policy` (auto: fcfs; the appliance resolves
    auto itself, knowing whether tenants are configured)."""
    return "fcfs" if name == "auto" else name


@dataclass(frozen=True)
class TenantStats:
    """One tenant's requests in the engine, and its virtual token counter (fair policies;
    None under fcfs and priority)."""

    running: int
    waiting: int
    virtual_tokens: float | None = None


class SchedulingPolicy:
    """The waiting queue, counters, deadlines and limits of one scheduler."""

    def __init__(self, config: SchedulerConfig):
        self.name = resolve_policy(config.policy)
        self.rules = ChargeRules.of(config)
        self.counter = VirtualTokenCounter(self.rules) if self.name in FAIR_POLICIES else None
        self.queue = TenantQueue(self.name, self.counter)
        self.deadlines = DeadlineHeap()
        self.rates = TokenRateLimiter()
        # Admission may preempt an over-share tenant's request when every seat is taken
        # (see Scheduler._swap_for_share); only the fair policies know shares.
        self.preempt_for_share = config.preempt_for_fairness and self.counter is not None
        # `deadline` admits requests that can no longer make their deadline only after those
        # that can (`feasibility`); the step timer feeds its estimate.
        self.defers_late = self.name == "deadline" and config.defer_late_requests
        self.step_timer = StepTimer() if self.defers_late else None
        self._chunk = config.max_num_batched_tokens
        self._tenants_seen = False  # some request came from a tenant other than default

    # ---- admission -----------------------------------------------------------------------
    def check_admission(self, request: Request, now: float, max_queue_len: int) -> Request | None:
        """Raises if `request` may not be queued now (deadline passed, its tenant's
        `max_queued` or `tokens_per_minute`, a full queue it is the most over-share tenant
        of); returns a waiting request to push out to make room for it, or None."""
        admission.check_deadline(request.deadline, now)
        queue = self.queue
        admission.check_tenant_queue_room(request.tenant, queue.num_queued(request.tenant.name))
        self.rates.check(request, now)
        if len(queue) < max_queue_len:
            return None
        victim = overflow_victim(queue, request)
        if victim is None:
            admission.check_queue_room(len(queue), 1, max_queue_len)
        return victim

    def admitted(self, request: Request, now: float) -> None:
        """`request` is queued: track its deadline, take its token reservation."""
        self.deadlines.push(request)
        self.rates.reserve(request, now)
        if request.tenant.name != DEFAULT_TENANT_NAME:
            self._tenants_seen = True

    def expired(self, now: float, live: Mapping[str, Request]) -> list[Request]:
        """Requests in `live` whose deadline has passed by `now`."""
        if not len(self.deadlines):
            return []
        return self.deadlines.pop_expired(now, live)

    def step_started(self, now: float, busy: bool) -> None:
        """A step starts (`busy`: requests are running); feeds the step-time estimate."""
        if self.step_timer is not None:
            self.step_timer.step_started(now, busy)

    def is_late(self, request: Request, now: float) -> bool:
        """`deadline` with deferral on: `request`'s remaining work at the recent step time
        ends after its deadline (`feasibility.is_late`); always False otherwise."""
        timer = self.step_timer
        return timer is not None and is_late(request, now, timer.step_s, self._chunk)

    # ---- charges ---------------------------------------------------------------------------
    def charge_admitted(self, request: Request, start: int, n: int) -> None:
        """Admitted this step with `start` tokens already cached (or forked) and `n` to run."""
        counter = self.counter
        if counter is not None:
            if start:
                counter.charge_cache_hits(request, start)
            counter.charge_scheduled(request, start, n)

    def charge_running(self, running: list[Request], num_scheduled: dict[str, int]) -> None:
        """The running requests scheduled this step (before any admission, and before their
        `num_computed_tokens` advance): a flooding tenant's decodes raise its counter before
        a tenant that just arrived, lifted to it, competes for a seat."""
        if self.counter is not None:
            self.counter.charge_running(running, num_scheduled)

    # ---- preemption and finishing ----------------------------------------------------------
    def pick_victim(self, running: list[Request]) -> int:
        return pick_victim(self.name, running, self.counter)

    def on_finish(self, request: Request, now: float) -> None:
        """`request` left the engine (any outcome): settle its token reservation."""
        self.rates.settle(request, now)

    # ---- reading ---------------------------------------------------------------------------
    def tenant_stats(self, running: list[Request]) -> dict[str, TenantStats]:
        """Per tenant: running, waiting, counter. Empty while only the default tenant was
        ever seen under fcfs or priority (nothing per tenant to tell)."""
        if self.counter is None and not self._tenants_seen:
            return {}
        run: dict[str, int] = {}
        for r in running:
            run[r.tenant.name] = run.get(r.tenant.name, 0) + 1
        wait = {name: count for name, _, count in self.queue.backlog()}
        counters = self.counter.snapshot() if self.counter is not None else {}
        names = sorted(set(run) | set(wait) | set(counters))
        return {
            n: TenantStats(
                run.get(n, 0),
                wait.get(n, 0),
                counters.get(n, 0.0) if self.counter is not None else None,
            )
            for n in names
        }
