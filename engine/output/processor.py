"""Turns scheduler updates into `RequestDelta`s: detokenization, stop strings, logprobs, n > 1.

A user request with `n` samples is a *group* of `n` engine `Request`s. This module keeps one
incremental detokenizer per sample and reports, per step, only what each sample gained:
new token ids, new text (text that may still turn into a stop string is held back until it
is resolved) and new logprobs, plus the sample's finish once (see `request_output` for the
delta contract). Nothing already reported is copied again, so a stream costs time linear
in its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request, RequestStatus, RequestTimes
from engine.core.step_io import RunnerOutput, TokenLogprobs
from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.request_output import RequestDelta, RequestMetrics, SampleDelta, SampleError
from engine.output.tokenizer import Tokenizer


@dataclass
class SampleState:
    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""  # text released by the detokenizer, not reported yet
    num_seen_tokens: int = 0
    num_sent_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # not reported yet; None: not asked for
    cumulative_logprob: float | None = None
    finish_sent: bool = False
    error: SampleError | None = None  # this sample ended by its own constraints


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # the whole group failed (a failed step)
    embedding: list[float] | None = None  # a prefill-only request's vector, once pooled
    _first_sent: bool = field(default=False)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)

    def take_delta(self) -> RequestDelta:
        """What the group gained since the previous call (the first call adds the prompt)."""
        outs = []
        finished = True
        for i, s in enumerate(self.samples):
            if not s.request.is_finished:
                finished = False
            d = _take_sample_delta(i, s)
            if d is not None:
                outs.append(d)
        delta = RequestDelta(
            self.request_id,
            outs,
            finished,
            error=self.error,
            embedding=self.embedding if finished else None,
        )
        if not self._first_sent:
            self._first_sent = True
            delta.prompt, delta.prompt_token_ids = self.prompt, self.prompt_token_ids
            if self.prompt_logprobs is not None:
                delta.prompt_logprobs = [None, *self.prompt_logprobs]
            delta.metrics = self._metrics()
        elif finished:
            delta.metrics = self._metrics()
        return delta

    def _metrics(self) -> RequestMetrics:
        samples = [s.request for s in self.samples]
        times = [r.times for r in samples]
        return RequestMetrics(
            arrival_time=times[0].arrival,
            first_scheduled_time=min(
                (t.first_scheduled for t in times if t.first_scheduled), default=None
            ),
            first_token_time=min((t.first_token for t in times if t.first_token), default=None),
            last_token_time=max((t.last_token for t in times if t.last_token), default=None),
            finished_time=max((t.finished or 0.0 for t in times), default=None) or None,
            preempted_times=sorted(p for t in times for p in t.preempted),
            num_cached_tokens=samples[0].num_cached_tokens,
            spec_num_drafts=sum(r.spec.num_drafts for r in samples if r.spec),
            spec_num_draft_tokens=sum(r.spec.num_draft_tokens for r in samples if r.spec),
            spec_num_accepted_tokens=sum(r.spec.num_accepted_tokens for r in samples if r.spec),
            tier_cached_tokens=dict(samples[0].tier_cached_tokens),
            kv_load_start_time=times[0].kv_load_started,
            kv_load_end_time=times[0].kv_load_finished,
            expired_time=min((t.expired for t in times if t.expired), default=None),
            queue_steps=_steps_since_queued(times, "first_scheduled_step"),
            ttft_steps=_steps_since_queued(times, "first_token_step"),
        )


def _steps_since_queued(times: list[RequestTimes], field: str) -> int | None:
    """Steps from the request's queueing to the first of its samples' `field` step."""
    steps = [getattr(t, field) for t in times if getattr(t, field) is not None]
    queued = times[0].queued_step
    return min(steps) - queued if steps and queued is not None else None


def _take_sample_delta(index: int, s: SampleState) -> SampleDelta | None:
    req = s.request
    finish = req.status.finish_reason if req.is_finished and not s.finish_sent else None
    new_ids = (
        req.output_token_ids[s.num_sent_tokens :]
        if s.num_sent_tokens < req.num_output_tokens
        else []
    )
    if not (new_ids or s.text or s.logprobs or finish):
        return None
    s.num_sent_tokens += len(new_ids)
    lps, text = s.logprobs, s.text
    if lps is not None:
        s.logprobs = []
    s.text = ""
    if finish is not None:
        s.finish_sent = True
    return SampleDelta(
        index=index,
        text=text,
        token_ids=new_ids,
        logprobs=lps,
        cumulative_logprob=s.cumulative_logprob,
        finish_reason=finish,
        stop_reason=req.stop_reason if finish is not None else None,
        error=s.error if finish is not None else None,
    )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self.parent_of: dict[str, str] = {}
        self._sample_of: dict[str, SampleState] = {}  # sample request id -> its state

    def add_group(self, request_id: str, prompt: str | None, requests: list[Request]) -> None:
        samples = []
        for req in requests:
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.sampling_params
            )
            wants_lp = req.sampling_params.logprobs is not None
            sample = SampleState(
                req,
                detok,
                logprobs=[] if wants_lp else None,
                cumulative_logprob=0.0 if wants_lp else None,
            )
            samples.append(sample)
            self.parent_of[req.request_id] = request_id
            self._sample_of[req.request_id] = sample
        wants_plp = requests[0].sampling_params.prompt_logprobs is not None
        self.groups[request_id] = RequestGroup(
            request_id,
            prompt,
            requests[0].prompt_token_ids,
            samples,
            prompt_logprobs=[] if wants_plp else None,
        )

    def child_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return [s.request.request_id for s in group.samples] if group else []

    def remove_group(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group:
            for s in group.samples:
                self.parent_of.pop(s.request.request_id, None)
                self._sample_of.pop(s.request.request_id, None)

    def process(
        self, updated: list[Request], runner_output: RunnerOutput
    ) -> tuple[list[str], list[tuple[Request, str, int]]]:
        """Returns the ids of groups that progressed and the stop strings the detokenizer
        found, as (sample request, stop string, output tokens up to the one that completed
        it) triples. This module never writes a request's status: the caller reports each
        stop string to the scheduler (`Scheduler.stop_on_string`), then calls
        `finalize_stop` for each, then `delta_for` per group.

        Several new tokens in one step (speculative decoding) are detokenized one at a time,
        exactly as if they had come in one step each: a stop string completed by one of them
        ends the output there, and the later tokens (and their logprobs) are dropped."""
        step_lp: dict[str, list[TokenLogprobs] | None] = {}
        if runner_output.logprobs is not None:
            step_lp = dict(zip(runner_output.req_ids, runner_output.logprobs, strict=True))
        for rid, chunk in runner_output.prompt_logprobs.items():
            group = self.groups.get(self.parent_of.get(rid, ""))
            if group is not None and group.prompt_logprobs is not None:
                # Replaces entries a recomputed prompt already delivered, appends the rest.
                end = chunk.first + len(chunk.logprobs)
                group.prompt_logprobs[chunk.first : end] = chunk.logprobs
        for rid, vector in runner_output.pooled.items():
            group = self.groups.get(self.parent_of.get(rid, ""))
            if group is not None:
                group.embedding = vector

        touched: dict[str, None] = {}  # group ids in order, once each
        stops: list[tuple[Request, str, int]] = []
        parent_of, sample_of = self.parent_of, self._sample_of
        for req in updated:
            rid = req.request_id
            parent = parent_of.get(rid)
            if parent is None:
                continue
            sample = sample_of[rid]
            out_ids = req.output_token_ids
            seen = sample.num_seen_tokens
            new_tokens = out_ids[seen:]
            sample.num_seen_tokens = len(out_ids)
            if new_tokens and _ends_on_stop_token(req):
                # Like vLLM: EOS / stop-token ids end the text without adding their own.
                text_tokens = new_tokens[:-1]
            else:
                text_tokens = new_tokens
            detok = sample.detokenizer
            stop, kept = _detokenize(detok, text_tokens) if text_tokens else (None, 0)
            if stop is None and req.is_finished and not detok.finished:
                stop = detok.flush()  # text held back at the end may complete a stop string
                kept = len(new_tokens)
            elif stop is None:
                kept = len(new_tokens)
            # No new token (a max_tokens=0 request finishing): its sample's logprobs are moot.
            lps = step_lp.get(rid) if step_lp else None
            if sample.logprobs is not None and lps and kept:
                for lp in lps[:kept]:
                    sample.logprobs.append(lp)
                    sample.cumulative_logprob += lp.logprob
            if stop is not None:
                stops.append((req, stop, seen + kept))
                sample.num_seen_tokens = seen + kept
            else:
                sample.text += detok.get_delta()
            touched[parent] = None
        return list(touched), stops

    def fail_sample(self, sample_id: str, error: SampleError) -> str | None:
        """Records why a sample the scheduler has finished with an error ended, and releases
        the text its detokenizer held back; returns its group's id (None if not held)."""
        sample = self._sample_of.get(sample_id)
        if sample is None:
            return None
        sample.error = error
        sample.detokenizer.flush()  # a stop string it would complete is moot now
        self._drain_text(sample)
        return self.parent_of[sample_id]

    def finalize_stop(self, sample_id: str) -> None:
        """Takes the text of a sample the scheduler has stopped on a stop string."""
        self._drain_text(self._sample_of[sample_id])

    def _drain_text(self, sample: SampleState) -> None:
        """Moves the text the detokenizer released into the sample's unsent text (a
        finished sample's detokenizer was flushed by `process` or by its stop string)."""
        sample.text += sample.detokenizer.get_delta()

    def delta_for(self, request_id: str) -> RequestDelta | None:
        """What the group gained since its previous delta."""
        group = self.groups.get(request_id)
        return group.take_delta() if group else None


def _detokenize(detok: IncrementalDetokenizer, tokens: list[int]) -> tuple[str | None, int]:
    """Feeds `tokens` one at a time; (the stop string one completed, tokens fed up to it),
    or (None, len(tokens))."""
    if len(tokens) == 1:
        return detok.update(tokens), 1
    for i, tok in enumerate(tokens):
        stop = detok.update([tok])
        if stop is not None:
            return stop, i + 1
    return None, len(tokens)


def _ends_on_stop_token(req: Request) -> bool:
    return (
        req.status == RequestStatus.FINISHED_STOPPED
        and not isinstance(req.stop_reason, str)
        and not req.sampling_params.include_stop_str_in_output
    )
