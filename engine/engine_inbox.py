"""What crosses between the callers' event loops and AsyncEngine's engine thread.

Callers put items in the inbox (an add, an abort, an adapter removal); the engine thread
handles them between steps and answers by scheduling calls back on each caller's own loop:
one `Deliveries` per loop iteration, run in order with one `call_soon_threadsafe` per event
loop (`deliver`). An adapter removal may wait across many iterations, until the last
request using the adapter is gone: `PendingRemovals` keeps those.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import EngineDeadError
from engine.output.request_output import OutputAccumulator
from engine.request_stream import RequestStream
from engine.stepped_engine import PreparedLike, SteppedEngine

# Per event loop, the calls one engine-loop iteration schedules there, in order.
Deliveries = dict[asyncio.AbstractEventLoop, list[Callable[[], None]]]


@dataclass
class Add:
    prepared: PreparedLike
    stream: RequestStream
    ack: asyncio.Future
    tenant: str | None = None  # the tenant's name, for finish listeners (None: default)


@dataclass
class Abort:
    request_id: str | None  # None: every request in flight
    exc: BaseException | None = None  # delivered to the stream, if it is still listening


@dataclass
class RemoveLoRA:
    lora_name: str
    done: asyncio.Future  # resolved once no request uses the adapter
    loop: asyncio.AbstractEventLoop


@dataclass
class InFlight:
    """Engine-thread record of one request: its stream and the sum of its deltas (what
    finish listeners get, built once when it ends)."""

    stream: RequestStream
    total: OutputAccumulator
    tenant: str | None = None  # the tenant's name (None: the default tenant)


class PendingRemovals:
    """Engine thread only: adapter removals the engine has begun, until no request uses the
    adapter. The engine refuses new requests for it from `begin` on."""

    def __init__(self, engine: SteppedEngine):
        self._engine = engine
        self._items: list[RemoveLoRA] = []

    def __bool__(self) -> bool:
        return bool(self._items)

    def begin(self, item: RemoveLoRA, out: Deliveries) -> None:
        try:
            self._engine.remove_lora(item.lora_name)
        except Exception as e:  # LoRANotFoundError, or LoRA off
            out[item.loop].append(functools.partial(ack, item.done, e))
            return
        self._items.append(item)

    def settle(self, out: Deliveries, dead: bool) -> None:
        """Completes the removals whose adapter no request uses any more (all of them, with
        an EngineDeadError, once the engine is dead)."""
        pending = []
        for item in self._items:
            if not dead and self._engine.lora_in_use(item.lora_name):
                pending.append(item)
                continue
            err = EngineDeadError("the engine is not running") if dead else None
            out[item.loop].append(functools.partial(ack, item.done, err))
        self._items = pending


def ack(fut: asyncio.Future, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)


def deliver(out: Deliveries, abort: Callable[[str], None]) -> None:
    """Schedules each loop's calls there, in order, in one `call_soon_threadsafe`. A loop
    that has closed has nobody listening: its requests are aborted (`abort(request_id)`)."""
    for loop, calls in out.items():
        try:
            loop.call_soon_threadsafe(run_all, calls)
        except RuntimeError:  # that event loop is closed
            for call in calls:
                stream = getattr(getattr(call, "func", None), "__self__", None)
                if isinstance(stream, RequestStream):
                    abort(stream.request_id)


def run_all(calls: list[Callable[[], None]]) -> None:
    """Runs one engine iteration's deliveries for one event loop, in order."""
    for call in calls:
        call()
