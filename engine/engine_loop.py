"""The engine thread's side of AsyncEngine: wait for work, take the inbox, step, deliver.

`EngineLoop` is a part of `AsyncEngine` (engine/async_engine.py, whose docstring draws the
two threads), kept in its own module because it is the other thread's job: everything here
runs on the engine thread, except `_die`, which any thread may call. One turn of `_run`:
sleep on the condition until there is an inbox, work or a stop; hand the inbox's adds and
aborts to the engine; run one step and turn its deltas into deliveries for each stream's
event loop; settle adapter removals; deliver. A failed step fails only its requests (or,
after `max_consecutive_failures` in a row or an `EngineDeadError`, the engine). It reads and
changes AsyncEngine's state, declared below; AsyncEngine owns it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from engine.engine_inbox import (
    Abort,
    Add,
    Deliveries,
    InFlight,
    PendingRemovals,
    RemoveLoRA,
    ack,
    deliver,
)
from engine.errors import EngineDeadError, EngineError, InvalidRequestError, RequestFailedError
from engine.output.request_output import OutputAccumulator, RequestDelta
from engine.request_stream import FinishedRequest
from engine.stepped_engine import SteppedEngine

# The logger of async_engine.py: the loop's records keep the name operators filter on.
logger = logging.getLogger("engine.async_engine")

__all__ = ["EngineLoop"]


class EngineLoop:
    """AsyncEngine's engine-thread methods (a mixin of `AsyncEngine`)."""

    # AsyncEngine's state this part reads and changes (set in `AsyncEngine.__init__`).
    engine: SteppedEngine
    max_consecutive_failures: int
    num_steps: int
    num_failed_steps: int
    _cond: threading.Condition
    _inbox: list[Add | Abort | RemoveLoRA]
    _pending: int
    _streams: dict[str, InFlight]
    _listeners: list[Callable[[FinishedRequest], None]]
    _removals: PendingRemovals
    _stats: object
    _stopping: bool
    _dead: str | None
    _consecutive_failures: int
    _step_started: float | None
    abort: Callable[[str], None]

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stopping or self._has_work()):
                        self._cond.wait()
                    inbox, self._inbox = self._inbox, []
                    stopping = self._stopping
                out: Deliveries = defaultdict(list)
                self._handle_inbox(inbox, out)
                if self._has_work() and not stopping:
                    self._step(out)
                if self._removals:
                    self._removals.settle(out, dead=self._dead is not None)
                self._stats = self.engine.stats()
                deliver(out, self.abort)
                if stopping or self._dead is not None:
                    break
        except BaseException as e:  # a bug in the loop itself: never leave callers hanging
            logger.exception("engine loop crashed")
            self._die(f"engine loop crashed: {type(e).__name__}: {e}")

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _has_work(self) -> bool:
        return self._dead is None and self.engine.has_unfinished_requests()

    def _handle_inbox(self, inbox: list[Add | Abort | RemoveLoRA], out: Deliveries) -> None:
        for item in inbox:
            if isinstance(item, Abort):
                ids = list(self._streams) if item.request_id is None else [item.request_id]
                for rid in ids:
                    self._abort_one(rid, item.exc, out)
                continue
            if isinstance(item, RemoveLoRA):
                self._removals.begin(item, out)
                continue
            with self._cond:
                self._pending -= 1
            err: BaseException | None = None
            try:
                if self._dead is not None or self._stopping:
                    raise EngineDeadError("the engine is not running")
                self.engine.add_prepared(item.prepared)
                stream = item.stream
                self._streams[stream.request_id] = InFlight(
                    stream, OutputAccumulator(stream.request_id, stream.n), item.tenant
                )
            except (InvalidRequestError, EngineError) as e:
                err = e
            except Exception as e:
                logger.exception("add_prepared failed")
                err = RequestFailedError(f"the engine could not add the request: {e}")
            out[item.stream.loop].append(functools.partial(ack, item.ack, err))

    def _abort_one(self, rid: str, exc: BaseException | None, out: Deliveries) -> None:
        held = self._streams.pop(rid, None)
        if held is None:
            return
        try:
            self.engine.abort(rid)
        except Exception:
            logger.exception("abort failed", extra={"fields": {"request_id": rid}})
        if exc is not None:
            out[held.stream.loop].append(functools.partial(held.stream.fail, exc))
        self._notify_finished(rid, "abort", held)

    def _step(self, out: Deliveries) -> None:
        self._step_started = time.monotonic()
        try:
            deltas = self.engine.step()
        except Exception as e:
            self._on_step_failure(e, out)
            return
        finally:
            self._step_started = None
        self.num_steps += 1
        self._consecutive_failures = 0
        for delta in deltas:
            self._deliver(delta, out)

    def _deliver(self, delta: RequestDelta, out: Deliveries) -> None:
        held = self._streams.get(delta.request_id)
        if held is None:
            return
        held.total.add(delta)
        stream = held.stream
        if delta.error:  # the request as a whole failed (one sample's own failure is a delta)
            err_type = delta.error_type or RequestFailedError  # a deadline: its own type
            out[stream.loop].append(functools.partial(stream.fail, err_type(delta.error)))
        else:
            out[stream.loop].append(functools.partial(stream.put, delta))
        if delta.finished or delta.error:
            del self._streams[delta.request_id]
            self._notify_finished(delta.request_id, None, held)

    def _on_step_failure(self, e: Exception, out: Deliveries) -> None:
        self.num_failed_steps += 1
        self._consecutive_failures += 1
        message = f"engine step failed: {type(e).__name__}: {e}"
        if isinstance(e, EngineDeadError):  # e.g. a tensor-parallel worker died: no retries
            logger.error("engine step failed for good: %s", e)
            self._fail_everything(message, out)
            self._die(message)
            return
        fields = {
            "consecutive_failures": self._consecutive_failures,
            "in_flight": len(self._streams),
        }
        logger.error("engine step failed", exc_info=True, extra={"fields": fields})
        # Only the requests of the failed step are suspect (their K/V, sampler state); the
        # others wait in the queue untouched.
        try:
            failed = self.engine.fail_step(message)
        except Exception:
            logger.exception("failing the step's requests failed")
            self._die(f"{message}; failing the requests in flight also failed")
            return
        for delta in failed:
            if not delta.error:
                delta.error = message
            self._deliver(delta, out)
        for rid in list(self._streams):  # anything the engine no longer holds would wait forever
            if not self.engine.has_request(rid):
                self._abort_one(rid, RequestFailedError(message), out)
        if self._consecutive_failures >= self.max_consecutive_failures:
            self._die(f"{self._consecutive_failures} consecutive failing steps; last: {message}")

    def _fail_everything(self, message: str, out: Deliveries) -> None:
        """Every request the engine holds fails with `message` (the engine cannot go on)."""
        try:
            failed = self.engine.fail_all(message)
        except Exception:
            logger.exception("failing the requests in flight failed")
            failed = []
        for delta in failed:
            if not delta.error:
                delta.error = message
            self._deliver(delta, out)

    def _die(self, reason: str) -> None:
        """Marks the engine dead and fails every stream and queued add; runs on any thread."""
        self._dead = reason
        logger.critical("engine is dead", extra={"fields": {"reason": reason}})
        with self._cond:
            inbox, self._inbox = self._inbox, []
        out: Deliveries = defaultdict(list)
        exc = EngineDeadError(f"the engine is not running: {reason}")
        for item in inbox:
            if isinstance(item, Add):
                with self._cond:
                    self._pending -= 1
                out[item.stream.loop].append(functools.partial(ack, item.ack, exc))
            elif isinstance(item, RemoveLoRA):
                out[item.loop].append(functools.partial(ack, item.done, exc))
        for rid in list(self._streams):
            self._abort_one(rid, exc, out)
        self._removals.settle(out, dead=True)
        deliver(out, self.abort)

    def _notify_finished(self, rid: str, reason: str | None, held: InFlight) -> None:
        """`reason` None: the request's own outcome (else "abort"); the whole output is built
        here, once, and only when someone listens."""
        if not self._listeners:
            return
        info = FinishedRequest.of(rid, reason, held.total, held.tenant)
        for fn in self._listeners:
            try:
                fn(info)
            except Exception:
                logger.exception("finish listener failed")
