"""LoRA adapters in the scheduler: the slot limit and the per-adapter counts.

The runner holds `max_loras` adapters on the device at once, so the running requests may
use at most that many distinct adapters; a waiting request for one more is skipped (keeping
its place) until a running adapter's requests are gone. Requests are told apart by
`Request.lora_key` (None for the base model), counted by adapter name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from engine.core.request import Request


class AdapterSlots:
    """The distinct adapters the running requests hold during one scheduling pass."""

    def __init__(self, max_loras: int | None, running: Iterable[Request]):
        self.max_loras = max_loras  # None: LoRA off, no limit
        self.keys = None if max_loras is None else {r.lora_key for r in running} - {None}

    def admits(self, req: Request) -> bool:
        """Whether `req` may start now without needing one slot too many."""
        if self.keys is None or req.lora_key is None or req.lora_key in self.keys:
            return True
        return len(self.keys) < self.max_loras

    def add(self, req: Request) -> None:
        if self.keys is not None and req.lora_key is not None:
            self.keys.add(req.lora_key)


def count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per adapter name; the base model is left out."""
    return dict(Counter(r.lora_request.lora_name for r in requests if r.lora_request is not None))


def uses_adapter(requests: Iterable[Request], lora_name: str) -> bool:
    return any(
        r.lora_request is not None and r.lora_request.lora_name == lora_name for r in requests
    )
