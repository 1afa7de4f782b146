"""The global queue bound (`scheduler.max_queue_len`) without letting one tenant's flood
refuse another: when the queue is full, the most over-share tenant's requests go first.

A tenant's load on the queue is its waiting requests over its weight. When a request
arrives at a full queue: if its own tenant would then be the most loaded (ties included),
it is refused (`QueueFullError`, as before tenants existed: with one tenant this is the
only case); otherwise the request the most loaded tenant's queue would take last is
pushed out (it fails with `QueueFullError`; it has usually never run) and the arrival
takes its place. A flood therefore fills the queue only while nobody else is waiting.
"""

from __future__ import annotations

from engine.core.policy.tenant_queue import TenantQueue
from engine.core.request import Request
from engine.errors import QueueFullError


def overflow_victim(queue: TenantQueue, arriving: Request) -> Request | None:
    """The waiting request to push out for `arriving` at a full queue, or None to refuse
    `arriving` itself."""
    me = arriving.tenant
    mine = (queue.num_queued(me.name) + 1) / me.weight
    top_name, top_load = None, mine
    for name, weight, count in queue.backlog():
        if name == me.name:
            continue
        load = count / weight
        if load > top_load:
            top_name, top_load = name, load
    return None if top_name is None else queue.last_of(top_name)


def pushed_out_error(victim: Request, max_queue_len: int) -> QueueFullError:
    """What the caller of a request pushed out of the full queue gets."""
    return QueueFullError(
        f"pushed out of the full waiting queue ({max_queue_len} requests): tenant "
        f"{victim.tenant.name!r} holds more than its share of it; retry later"
    )
