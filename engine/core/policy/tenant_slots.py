"""Running requests per tenant, for one step's admissions: `max_running`, the weighted seat
shares, and the fair order's slack for a tenant under its share.

Counted once, from the running list, the first time a step needs them (a step whose
candidates have no limit and no share to compare counts nothing), then kept up to date
as the step admits and preempts.

A tenant's share of the seats is `max_num_seqs` times its weight over the weights of the
tenants running or waiting. Two rules read it:

- the fair order (`TenantQueue`, fair policies): a tenant that would still be within its
  share with one more seat is offered as if its counter were lower by its head request's
  whole cost (`share_slack`), so a light tenant, one request ahead on the counter because
  its last request was just charged, does not wait behind a flood for the flood to catch
  up. Backlogged counters then stay within one more request's cost of each other than
  under the plain lowest-counter rule: still the VTC bound, with `max_num_seqs + 1`
  requests in it instead of `max_num_seqs`;
- `scheduler.preempt_for_fairness` (`share_victim`): with every seat held, the same tenant
  may take a seat from one over its share that is ahead of it on that counter, once it
  has waited `preempt_for_fairness_wait_steps` steps for a seat to free by itself.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from engine.core.policy.charges import ChargeRules
from engine.core.policy.fair_share import VirtualTokenCounter
from engine.core.request import Request
from engine.core.request_queue import priority_key


class TenantSlots:
    def __init__(self, running: list[Request], max_seqs: int = 0):
        self._running = running
        self._max_seqs = max_seqs
        self._counts: dict[str, int] | None = None
        self._weights: dict[str, float] = {}  # of the tenants running (counted with them)

    @property
    def max_seqs(self) -> int:
        return self._max_seqs

    def counts(self) -> dict[str, int]:
        if self._counts is None:
            counts: dict[str, int] = {}
            weights = self._weights
            for r in self._running:
                name = r.tenant.name
                counts[name] = counts.get(name, 0) + 1
                weights.setdefault(name, r.tenant.weight)
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
            self._weights.setdefault(name, request.tenant.weight)

    def removed(self, request: Request) -> None:
        if self._counts is not None:
            self._counts[request.tenant.name] -= 1

    def weights(self, backlog: Iterable[tuple[str, float, int]]) -> dict[str, float]:
        """Weight by tenant, of the tenants running or in `backlog` (the waiting queue's)."""
        self.counts()
        weights = dict(self._weights)
        for name, weight, _ in backlog:
            weights.setdefault(name, weight)
        return weights

    def within_share(self, name: str, weights: dict[str, float]) -> bool:
        """Tenant `name` would hold no more than its weighted share of the seats with one
        more (`weights`: from `weights`)."""
        return self.seats_left(name, weights) >= 1

    def seats_left(self, name: str, weights: dict[str, float]) -> float:
        """Seats tenant `name` may still take within its weighted share (negative: over)."""
        return self.share(name, weights) - self.counts().get(name, 0)

    def share(self, name: str, weights: dict[str, float]) -> float:
        """Tenant `name`'s weighted share of the seats."""
        return self._max_seqs * weights[name] / sum(weights.values())


def share_slack(request: Request, rules: ChargeRules) -> float:
    """The whole cost of `request` on its tenant's counter: its prompt and its output cap,
    charged as scheduled, over its tenant's weight."""
    cost = rules.input_token * request.num_prompt_tokens
    cost += rules.output_token * (request.max_tokens or 0)
    return cost / request.tenant.weight


def share_victim(
    head: Request,
    running: list[Request],
    tenants: TenantSlots,
    weights: dict[str, float],
    counter: VirtualTokenCounter,
    keep: Container[str],
) -> int | None:
    """Index in `running` of the request to preempt so that `head` can take its seat, or
    None when no swap is due.

    A swap is due when `head`'s tenant would still be within its share with one more seat,
    and another tenant holds more seats than its share and is ahead of it on the counter
    as the fair order compares them (by more than `head`'s slack): the victim is that
    tenant's request its queue would take last (largest (priority, arrival)), among those
    not in `keep` (the requests admitted this step) and without a deadline: recomputing a
    request could make it miss its deadline, which fairness does not call for (measured:
    with deadlines on every request under overload, swapping them cost `deadline` a third
    of its goodput).
    """
    me = head.tenant.name
    if not tenants.within_share(me, weights):
        return None
    mine = counter.value(me) - int(tenants.share(me, weights)) * share_slack(head, counter.rules)
    total = sum(weights.values())
    max_seqs = tenants.max_seqs
    best, best_excess = None, 0.0
    for name, held in tenants.counts().items():
        if name == me or counter.value(name) <= mine:
            continue
        excess = held / weights[name] - max_seqs / total  # seats per weight above the fair rate
        if excess > best_excess:
            best, best_excess = name, excess
    if best is None:
        return None
    victim, victim_key = None, None
    for j, r in enumerate(running):
        if r.tenant.name != best or r.request_id in keep or r.deadline is not None:
            continue
        k = priority_key(r)
        if victim_key is None or k >= victim_key:
            victim, victim_key = j, k
    return victim
