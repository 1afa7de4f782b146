"""Running requests per tenant, for one step's admissions: `max_running`, and the seat
shares `scheduler.preempt_for_fairness` compares.

Counted once, from the running list, the first time a step needs them (a step whose
candidates have no limit and no fairness preemption counts nothing), then kept up to date
as the step admits and preempts.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from engine.core.policy.fair_share import VirtualTokenCounter
from engine.core.request import Request
from engine.core.request_queue import priority_key


class TenantSlots:
    def __init__(self, running: list[Request]):
        self._running = running
        self._counts: dict[str, int] | None = None

    def counts(self) -> dict[str, int]:
        if self._counts is None:
            counts: dict[str, int] = {}
            for r in self._running:
                name = r.tenant.name
                counts[name] = counts.get(name, 0) + 1
            self._counts = counts
        return self._counts

    def admits(self, request: Request) -> bool:
        """False when `request`'s tenant already runs `max_running` requests."""
        limit = request.tenant.max_running
        return limit is None or self.counts().get(request.tenant.name, 0) < limit

    def added(self, request: Request) -> None:
        if self._counts is not None:
            name = request.tenant.name
            self._counts[name] = self._counts.get(name, 0) + 1

    def removed(self, request: Request) -> None:
        if self._counts is not None:
            self._counts[request.tenant.name] -= 1


def share_victim(
    head: Request,
    running: list[Request],
    counts: dict[str, int],
    backlog: Iterable[tuple[str, float, int]],
    max_seqs: int,
    counter: VirtualTokenCounter,
    keep: Container[str],
) -> int | None:
    """Index in `running` of the request to preempt so that `head` can take its seat, or
    None when no swap is due.

    A tenant's share of the seats is `max_seqs` times its weight over the weights of the
    tenants running or waiting. A swap is due when `head`'s tenant would still be within
    its share with one more seat, and another tenant holds more seats than its share and has
    a higher counter (it has been served more): the victim is that tenant's request its
    queue would take last (largest (priority, arrival)), among those not in `keep` (the
    requests admitted this step).
    """
    weights: dict[str, float] = {}
    for r in running:
        weights.setdefault(r.tenant.name, r.tenant.weight)
    for name, weight, _ in backlog:
        weights.setdefault(name, weight)
    total = sum(weights.values())
    me = head.tenant.name
    if (counts.get(me, 0) + 1) * total > max_seqs * weights[me]:
        return None
    mine = counter.value(me)
    best, best_excess = None, 0.0
    for name, held in counts.items():
        if name == me or counter.value(name) <= mine:
            continue
        excess = held / weights[name] - max_seqs / total  # seats per weight above the fair rate
        if excess > best_excess:
            best, best_excess = name, excess
    if best is None:
        return None
    victim, victim_key = None, None
    for j, r in enumerate(running):
        if r.tenant.name != best or r.request_id in keep:
            continue
        k = priority_key(r)
        if victim_key is None or k >= victim_key:
            victim, victim_key = j, k
    return victim
