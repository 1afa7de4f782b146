"""Which running request to preempt when the KV pool cannot cover the running batch.

- `fcfs`: the newest running request (the tail of the running list, admission order);
- `priority`: the largest priority value, latest arrival (ties: the later in running order);
- `fair`, `deadline`: a request of the tenant furthest above its share, i.e. with the
  highest virtual token counter among the tenants running; within it the request its
  tenant's queue would take last (largest (priority, arrival), or under `deadline` the
  latest deadline).

A victim other than the tail may already be scheduled in this step; the scheduler takes it
back out (`Scheduler._preempt`).
"""

from __future__ import annotations

from engine.core.policy.fair_share import VirtualTokenCounter
from engine.core.request import Request
from engine.core.request_queue import deadline_key, priority_key


def pick_victim(policy: str, running: list[Request], counter: VirtualTokenCounter | None) -> int:
    """Index in `running` (non-empty) of the request to preempt."""
    if policy == "priority":
        return _last_max(running, priority_key)
    if counter is None:  # fcfs
        return len(running) - 1
    within = deadline_key if policy == "deadline" else priority_key
    value = counter.value
    return _last_max(running, lambda r: (value(r.tenant.name), within(r)))


def _last_max(running: list[Request], key) -> int:
    best = 0
    best_key = key(running[0])
    for j in range(1, len(running)):
        k = key(running[j])
        if k >= best_key:  # ties: the later one in running order
            best, best_key = j, k
    return best
