"""The scheduler's waiting queue: one queue per tenant, the tenant to take from picked by
the scheduling policy.

Within a tenant, requests wait in the policy's order (`engine.core.request_queue`): FCFS
under `fcfs`, priority then arrival under `priority` and `fair`, earliest deadline first
under `deadline`. Across tenants the policy picks whose head goes next:

- `fcfs`: the head that a single arrival-ordered queue would hold first (a preempted
  request before any other, then the earliest arrival);
- `priority`: the best (priority, arrival) head;
- `fair`, `deadline`: the tenant with the lowest virtual token counter
  (`fair_share.VirtualTokenCounter`), ties to the earliest head; during a step's
  admissions (`offer_shares`) a tenant within its weighted seat share is compared with its
  counter lowered by its head's whole cost (`tenant_slots.share_slack`), so a light tenant
  is not held behind a flood by the charge of its own last request.

With one tenant (no tenants configured: everyone is `default`) this is exactly that
tenant's queue, at the cost of one dict lookup. A tenant that may not be offered for the
rest of a step (its `max_running` is reached) is *parked*: it keeps its requests and its
place, the queue is truthy only while some unparked tenant has a request, and
`unpark_all` ends the step (and the shares offered for it). `len()` counts every waiting request, parked or not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from engine.core.policy.fair_share import VirtualTokenCounter
from engine.core.policy.tenant_slots import TenantSlots, share_slack
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import RequestQueue, make_queue

# The order requests of one tenant wait in, by policy.
_WITHIN = {"fcfs": "fcfs", "priority": "priority", "fair": "priority", "deadline": "deadline"}
_PREEMPTED = RequestStatus.PREEMPTED


class TenantQueue:
    """Waiting requests by tenant name (see the module docstring)."""

    def __init__(self, policy: str, counter: VirtualTokenCounter | None = None):
        if policy not in _WITHIN:
            raise ValueError(f"scheduler.policy: unknown policy {policy!r}")
        if policy in ("fair", "deadline") and counter is None:
            raise ValueError(f"the {policy} policy needs a virtual token counter")
        self._order = _WITHIN[policy]
        self._counter = counter
        self._key = self._tenant_key(policy)
        # Backlogged tenants only (a tenant whose last request leaves is dropped), in the
        # order they became backlogged.
        self._subs: dict[str, RequestQueue] = {}
        self._parked: set[str] = set()
        self._slots: TenantSlots | None = None  # this step's seats (`offer_shares`)
        self._len = 0

    def _tenant_key(self, policy: str) -> Callable[[str, RequestQueue], Any]:
        if policy == "fcfs":
            return lambda name, sub: (sub.peek().status is not _PREEMPTED, sub.peek().times.arrival)
        if policy == "priority":
            return lambda name, sub: (sub.peek().priority, sub.peek().times.arrival)
        value = self._counter.value  # type: ignore[union-attr]
        return lambda name, sub: (value(name), sub.peek().times.arrival)

    # ---- entering ----------------------------------------------------------------------------
    def _sub_for(self, name: str, lift: bool) -> RequestQueue:
        sub = self._subs.get(name)
        if sub is None:
            if lift and self._counter is not None:
                self._counter.lift(name, self._subs)
            sub = self._subs[name] = make_queue(self._order)
        return sub

    def add(self, request: Request) -> None:
        """Queues a newly arrived request (its tenant, if it had nothing waiting, is lifted
        to the backlogged tenants' lowest counter: idling earns no credit)."""
        self._sub_for(request.tenant.name, lift=True).add(request)
        self._len += 1

    def requeue_preempted(self, request: Request) -> None:
        """Puts back a request that lost its blocks (first in its tenant's queue under
        fcfs, in order under the others)."""
        self._sub_for(request.tenant.name, lift=True).requeue_preempted(request)
        self._len += 1

    def restore(self, requests: list[Request]) -> None:
        """Puts back requests popped and skipped this step, each ahead of the rest of its
        tenant's queue, in order. Not an arrival: no counter is lifted."""
        by_tenant: dict[str, list[Request]] = {}
        for r in requests:
            by_tenant.setdefault(r.tenant.name, []).append(r)
        for name, rs in by_tenant.items():
            self._sub_for(name, lift=False).restore(rs)
        self._len += len(requests)

    # ---- the head --------------------------------------------------------------------------
    def _pick(self) -> str:
        """The tenant whose head goes next; IndexError when none may be offered."""
        subs, parked = self._subs, self._parked
        if len(subs) == 1 and not parked:
            return next(iter(subs))
        best: str | None = None
        best_key = None
        key = self._key if self._slots is None else self._share_key()
        for name, sub in subs.items():
            if name in parked:
                continue
            k = key(name, sub)
            if best is None or k < best_key:
                best, best_key = name, k
        if best is None:
            raise IndexError("no tenant has a request that may be offered")
        return best

    def _share_key(self) -> Callable[[str, RequestQueue], Any]:
        """The fair key during admissions: a tenant within its seat share competes with its
        counter lowered by its head's `share_slack`."""
        slots, counter = self._slots, self._counter
        assert slots is not None and counter is not None
        weights = slots.weights(self.backlog())
        value, rules = counter.value, counter.rules

        def key(name: str, sub: RequestQueue) -> tuple[float, float]:
            head = sub.peek()
            v = value(name)
            if slots.within_share(name, weights):
                v -= int(slots.share(name, weights)) * share_slack(head, rules)
            return v, head.times.arrival

        return key

    def peek(self) -> Request:
        return self._subs[self._pick()].peek()

    def pop(self) -> Request:
        name = self._pick()
        sub = self._subs[name]
        req = sub.pop()
        self._len -= 1
        if not sub:
            self._drop(name)
        return req

    def _drop(self, name: str) -> None:
        del self._subs[name]
        if self._counter is not None:
            self._counter.left(name)

    # ---- parking (per-tenant limits) --------------------------------------------------------
    def park(self, name: str) -> None:
        """Offers none of `name`'s requests until `unpark_all` (they keep their places)."""
        self._parked.add(name)

    def unpark_all(self) -> None:
        self._parked.clear()
        self._slots = None

    def offer_shares(self, slots: TenantSlots) -> None:
        """Fair policies, for one step's admissions (until `unpark_all`): the seats each
        tenant holds, so the order can favour a tenant within its share (module docstring).
        A no-op under fcfs and priority."""
        if self._counter is not None:
            self._slots = slots

    # ---- leaving and reading -----------------------------------------------------------------
    def remove(self, requests: Iterable[Request]) -> None:
        by_tenant: dict[str, list[Request]] = {}
        for r in requests:
            by_tenant.setdefault(r.tenant.name, []).append(r)
        for name, rs in by_tenant.items():
            sub = self._subs.get(name)
            if sub is None:
                continue
            before = len(sub)
            sub.remove(rs)
            self._len -= before - len(sub)
            if not sub:
                self._drop(name)

    def num_queued(self, name: str) -> int:
        """Requests of tenant `name` waiting."""
        sub = self._subs.get(name)
        return len(sub) if sub is not None else 0

    def backlog(self) -> Iterator[tuple[str, float, int]]:
        """(tenant name, weight, requests waiting) per backlogged tenant."""
        for name, sub in self._subs.items():
            yield name, sub.peek().tenant.weight, len(sub)

    def last_of(self, name: str) -> Request:
        """The request of tenant `name` that would be taken last."""
        return self._subs[name].peek_last()

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        if not self._parked:
            return bool(self._subs)
        return any(name not in self._parked for name in self._subs)

    def __iter__(self) -> Iterator[Request]:
        for sub in self._subs.values():
            yield from sub
