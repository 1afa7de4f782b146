"""Per-request deadlines: which unfinished requests' deadlines have passed, in O(log n).

A request may carry `deadline`, a time on the scheduler's clock (monotonic seconds) by
which it must have finished; the frontends set it from gRPC's deadline, HTTP's
`X-Request-Timeout`, KServe's `timeout` parameter or `server.default_request_timeout_s`.
At the start of every `schedule()` the scheduler ends each request whose deadline has
passed, whatever its state, before any compute of that step: a waiting one never gets a
step, a running one is aborted and its blocks freed (see `Scheduler._expire_deadlines`).

A heap keyed by deadline holds every request given one; finished requests are dropped
lazily when they reach the top, and the heap is rebuilt from the live ones whenever it
grows past twice the requests held, so a long deadline on a short request keeps nothing
alive for long.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from engine.core.request import Request, RequestStatus
from engine.errors import DeadlineExceededError

_SLACK = 64  # entries tolerated beyond twice the live requests before a rebuild


class DeadlineHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, request: Request) -> None:
        """Remembers `request`'s deadline (none: nothing to remember)."""
        if request.deadline is None:
            return
        self._seq += 1
        heapq.heappush(self._heap, (request.deadline, self._seq, request))

    def next_deadline(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_expired(self, now: float, live: Mapping[str, Request]) -> list[Request]:
        """Every request in `live` (by id, the very object) whose deadline is <= `now`, in
        deadline order; forgets them and any finished request met on the way."""
        heap = self._heap
        out: list[Request] = []
        while heap and heap[0][0] <= now:
            req = heapq.heappop(heap)[2]
            if live.get(req.request_id) is req:
                out.append(req)
        if len(heap) > 2 * len(live) + _SLACK:
            self._heap = [e for e in heap if live.get(e[2].request_id) is e[2]]
            heapq.heapify(self._heap)
        return out


def expiry_error(request: Request, now: float) -> DeadlineExceededError:
    """What the caller of `request`, whose deadline has passed, gets; stamps the time."""
    request.times.expired = now
    if request.status is RequestStatus.RUNNING:
        return DeadlineExceededError(
            "the request's deadline passed while it was running; it was stopped"
        )
    return DeadlineExceededError(
        "the request's deadline passed while it waited in the queue; nothing was computed"
    )
