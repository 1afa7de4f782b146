"""A step's results applied: the last part of a scheduling step's round trip.

`StepResults` is a part of `Scheduler` (engine/core/scheduler.py), kept in its own module
because it is a job of its own: taking the runner's `RunnerOutput` for a step and turning it
into request state. Sampled tokens are appended and stop conditions applied; speculative
proposals are settled (the rejected positions' computed count taken back, their blocks
truncated); prefill-only requests finish when their pooled vector returns; KV tier results
are taken in. It reads and changes the scheduler's state, declared below; the scheduler
owns it, and `_finish` (the scheduler's) releases what a finished request held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.core.request import Request, RequestStatus
from engine.core.step_io import RunnerOutput, SchedulerOutput
from engine.core.stop import check_stop

if TYPE_CHECKING:
    from engine.core.kv_cache.manager import KVCacheManager
    from engine.core.kv_tier.manager import KVTierManager
    from engine.core.spec.speculator import Speculator

__all__ = ["StepResults"]

_RUNNING = RequestStatus.RUNNING


class StepResults:
    """The scheduler's intake of a step's results (a mixin of `Scheduler`)."""

    # The scheduler's state this part reads and changes (set in `Scheduler.__init__`).
    kv_manager: KVCacheManager
    kv_tier: KVTierManager | None
    speculator: Speculator | None
    max_model_len: int
    requests: dict[str, Request]
    running: list[Request]
    num_steps_started: int
    clock: Callable[[], float]
    _in_flight: dict[str, int]
    _finish: Callable[[Request, float, bool], None]

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[Request]:
        """Appends sampled tokens, applies stop conditions, frees finished requests.

        Returns every request that got tokens this step (finished ones included). Tokens for
        requests no longer running (aborted or finished meanwhile) are dropped, and so is the
        token sampled at the end of a `max_tokens=0` request's prompt: it finishes with
        FINISHED_LENGTH and no output as soon as its whole prompt is computed.
        """
        now = self.clock()
        self._in_flight = {}
        if runner_output.kv_tier is not None and self.kv_tier is not None:
            self.kv_tier.apply(runner_output.kv_tier)
        requests, max_len = self.requests, self.max_model_len
        updated: list[Request] = []
        any_finished = False
        spec_ids = scheduler_output.spec_token_ids
        for rid, token_ids in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, strict=True
        ):
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING or not token_ids:
                continue
            draft = spec_ids.get(rid) if spec_ids else None
            if draft is not None:
                self._settle_speculation(req, draft, token_ids)
            if req.max_tokens == 0:  # prompt scoring: its prefill is done, the sample dropped
                req.status = RequestStatus.FINISHED_LENGTH
                stopped = True
            elif len(token_ids) == 1:  # the usual case: no per-token slicing
                req.append_output_token_ids(token_ids)
                stopped = check_stop(req, token_ids[0], max_len)
            else:
                stopped = self._append_until_stop(req, token_ids)
            if stopped:
                self._finish(req, now, in_batch=True)
                any_finished = True
            elif draft is not None or rid in scheduler_output.num_lookahead_tokens:
                self.kv_manager.truncate(req, req.num_computed_tokens)
            times = req.times
            if times.first_token is None:
                times.first_token = now
                times.first_token_step = self.num_steps_started
            times.last_token = now
            updated.append(req)
        if runner_output.pooled:
            any_finished |= self._finish_pooled(runner_output.pooled, now, updated)
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        if runner_output.draft_token_ids and self.speculator is not None:
            self.speculator.take_worker_proposals(requests, runner_output.draft_token_ids)
        return updated

    def _settle_speculation(self, req: Request, draft: list[int], token_ids: list[int]) -> None:
        """`req` ran 1 + len(draft) tokens and got `token_ids` back: the K/V of the first
        len(token_ids) positions (its last token and the accepted proposals) stand; the
        rejected positions are computed again as the tokens that replace them arrive."""
        req.num_computed_tokens -= 1 + len(draft) - len(token_ids)
        assert self.speculator is not None
        self.speculator.settle(req, len(draft), len(token_ids))

    def _finish_pooled(self, pooled: dict[str, list[float]], now: float, updated: list) -> bool:
        """Finishes the prefill-only requests whose vector came back (stopped: the prompt
        is all they had); appends them to `updated`. True if any finished."""
        done = False
        for rid in pooled:
            req = self.requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue  # aborted meanwhile: its vector is dropped
            req.status = RequestStatus.FINISHED_STOPPED
            self._finish(req, now, in_batch=True)
            updated.append(req)
            done = True
        return done

    def _append_until_stop(self, req: Request, token_ids: list[int]) -> bool:
        """Appends several tokens (speculative decoding), dropping any after a stop."""
        for i, tok in enumerate(token_ids):
            req.append_output_token_ids(token_ids[i : i + 1])
            if check_stop(req, tok, self.max_model_len):
                return True
        return False
