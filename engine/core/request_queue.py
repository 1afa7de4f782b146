"""Waiting queues for the scheduler: FCFS and priority, behind one small interface.

The scheduler only ever looks at the head, pops it, puts skipped requests back in front,
re-queues preempted requests and removes aborted ones. Both queues do the head operations
cheaply; removal from the middle is O(n), which is fine because it only happens on aborts.

These are the queues of one tenant: the scheduler's waiting queue is a
`engine.core.policy.tenant_queue.TenantQueue`, one of these per tenant with a request
waiting, which picks the tenant to take from by the scheduling policy.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from engine.core.request import Request


class RequestQueue(Protocol):
    """What the scheduler needs from a waiting queue."""

    def add(self, request: Request) -> None:
        """Queues a newly arrived request."""

    def requeue_preempted(self, request: Request) -> None:
        """Puts back a request that lost its blocks (FCFS: at the head)."""

    def restore(self, requests: list[Request]) -> None:
        """Puts back requests popped and skipped this step, ahead of the rest, in order."""

    def peek(self) -> Request: ...

    def peek_last(self) -> Request:
        """The request that would be taken last."""

    def pop(self) -> Request: ...

    def remove(self, requests: Iterable[Request]) -> None: ...

    def __len__(self) -> int: ...

    def __bool__(self) -> bool: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; a preempted request goes back to the head so it resumes first."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def requeue_preempted(self, request: Request) -> None:
        # Victims are taken newest first, so prepending each keeps them in arrival order.
        self._q.appendleft(request)

    def restore(self, requests: list[Request]) -> None:
        self._q.extendleft(reversed(requests))

    def peek(self) -> Request:
        return self._q[0]

    def peek_last(self) -> Request:
        return self._q[-1]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        if gone:
            self._q = deque(r for r in self._q if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


def priority_key(request: Request) -> tuple[int, float]:
    """Lower `priority` value first, then earlier arrival."""
    return (request.priority, request.times.arrival)


def deadline_key(request: Request) -> tuple[float, int, float]:
    """Earliest deadline first; requests without one after all that have one, then by
    priority and arrival."""
    d = request.deadline
    return (d if d is not None else float("inf"), request.priority, request.times.arrival)


class PriorityQueue:
    """Sorted by `key` (default: lower `priority` value first, then earlier arrival); ties
    keep insertion order.

    A sorted list rather than a heap: the head is `[0]`, iteration is in order (handy for
    tests and metrics), and the queue is bounded by `max_queue_len`, so the O(n) insert is a
    short memmove.
    """

    def __init__(self, key: Callable[[Request], Any] = priority_key) -> None:
        self._items: list[Request] = []
        self._key = key

    def add(self, request: Request) -> None:
        bisect.insort_right(self._items, request, key=self._key)

    def requeue_preempted(self, request: Request) -> None:
        # Back in priority order (its key did not change while it ran), ahead of equal keys:
        # it was admitted before them.
        bisect.insort_left(self._items, request, key=self._key)

    def restore(self, requests: list[Request]) -> None:
        # Samples of one `n > 1` request share a key; inserting in reverse, each ahead of its
        # equals, restores their original relative order.
        for r in reversed(requests):
            bisect.insort_left(self._items, r, key=self._key)

    def peek(self) -> Request:
        return self._items[0]

    def peek_last(self) -> Request:
        return self._items[-1]

    def pop(self) -> Request:
        return self._items.pop(0)

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        if gone:
            self._items = [r for r in self._items if id(r) not in gone]

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


def make_queue(order: str) -> RequestQueue:
    """One tenant's queue: "fcfs" (arrival, preempted first), "priority" (priority, then
    arrival) or "deadline" (earliest deadline, then priority and arrival)."""
    if order == "fcfs":
        return FCFSQueue()
    if order == "priority":
        return PriorityQueue()
    if order == "deadline":
        return PriorityQueue(deadline_key)
    raise ValueError(f"unknown queue order {order!r}")
