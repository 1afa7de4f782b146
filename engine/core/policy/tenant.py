"""A tenant as the scheduler sees it: a name, a weight and optional limits, carried by
every request (`Request.tenant`).

The appliance builds one `Tenant` per configured tenant (`server.tenants`) and hands the
same object to every request of that tenant; offline callers may build their own. Nothing
here knows about API keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_TENANT_NAME = "default"


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request is for, and the share and limits its tenant has.

    `weight`: the tenant's share of the engine relative to the others' under the fair
    policies (a tenant of weight 3 gets three times the tokens of one of weight 1 while
    both are backlogged). `max_running`: requests of this tenant in the running batch at
    once. `max_queued`: requests of this tenant in the waiting queue at once (more are
    refused with `QueueFullError`). `tokens_per_minute`: prompt + max_tokens reserved per
    request against a bucket refilled at this rate (see `token_rate`). None: no limit.
    """

    name: str = DEFAULT_TENANT_NAME
    weight: float = 1.0
    max_running: int | None = None
    max_queued: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tenant.name: must not be empty")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"tenant.weight: must be a finite number > 0, got {w!r}")
        for key in ("max_running", "max_queued", "tokens_per_minute"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"tenant.{key}: must be an integer >= 1 or None, got {v!r}")


DEFAULT_TENANT = Tenant()
