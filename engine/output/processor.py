"""Turns scheduler updates into `RequestOutput`s: detokenization, stop strings, logprobs, n > 1.

A user request with `n` samples is a *group* of `n` engine `Request`s. This module keeps one
incremental detokenizer per sample, gathers logprobs, and reports the group as one
`RequestOutput` whose text only ever grows (text that may still turn into a stop string is
held back until it is resolved), so a streaming frontend can send `text[len(sent):]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request, RequestStatus
from engine.core.step_io import RunnerOutput, TokenLogprobs
from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.request_output import CompletionOutput, RequestMetrics, RequestOutput
from engine.output.tokenizer import Tokenizer


@dataclass
class SampleState:
    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_seen_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    _finished_emitted: bool = field(default=False)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)

    def to_output(self) -> RequestOutput:
        outs = []
        for i, s in enumerate(self.samples):
            req = s.request
            outs.append(
                CompletionOutput(
                    index=i,
                    text=s.text,
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
        lead = self.samples[0].request
        t = lead.times
        metrics = RequestMetrics(
            arrival_time=t.arrival,
            first_scheduled_time=min(
                (
                    s.request.times.first_scheduled
                    for s in self.samples
                    if s.request.times.first_scheduled
                ),
                default=None,
            ),
            first_token_time=min(
                (s.request.times.first_token for s in self.samples if s.request.times.first_token),
                default=None,
            ),
            last_token_time=max(
                (s.request.times.last_token for s in self.samples if s.request.times.last_token),
                default=None,
            ),
            finished_time=max((s.request.times.finished or 0.0 for s in self.samples), default=None)
            or None,
            preempted_times=sorted(p for s in self.samples for p in s.request.times.preempted),
            num_cached_tokens=lead.num_cached_tokens,
        )
        plp = None
        if self.prompt_logprobs is not None:
            plp = [None, *self.prompt_logprobs]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            prompt_logprobs=plp,
            metrics=metrics,
            error=self.error,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self.parent_of: dict[str, str] = {}

    def add_group(self, request_id: str, prompt: str | None, requests: list[Request]) -> None:
        samples = []
        for req in requests:
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.sampling_params
            )
            wants_lp = req.sampling_params.logprobs is not None
            samples.append(
                SampleState(
                    req,
                    detok,
                    logprobs=[] if wants_lp else None,
                    cumulative_logprob=0.0 if wants_lp else None,
                )
            )
            self.parent_of[req.request_id] = request_id
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

    def process(
        self, updated: list[Request], runner_output: RunnerOutput
    ) -> tuple[list[str], list[tuple[Request, str]]]:
        """Returns the ids of groups that progressed and the stop strings the detokenizer
        found, as (sample request, stop string) pairs. This module never writes a request's
        status: the caller reports each stop string to the scheduler
        (`Scheduler.stop_on_string`), then calls `finalize_stop` for each, then `output_for`
        per group."""
        step_lp: dict[str, TokenLogprobs | None] = {}
        if runner_output.logprobs is not None:
            step_lp = dict(zip(runner_output.req_ids, runner_output.logprobs, strict=True))
        for rid, chunk in runner_output.prompt_logprobs.items():
            group = self.groups.get(self.parent_of.get(rid, ""))
            if group is not None and group.prompt_logprobs is not None:
                # Replaces entries a recomputed prompt already delivered, appends the rest.
                end = chunk.first + len(chunk.logprobs)
                group.prompt_logprobs[chunk.first : end] = chunk.logprobs

        touched: dict[str, RequestGroup] = {}
        stops: list[tuple[Request, str]] = []
        for req in updated:
            parent = self.parent_of.get(req.request_id)
            if parent is None:
                continue
            group = self.groups[parent]
            sample = next(s for s in group.samples if s.request is req)
            new_tokens = req.output_token_ids[sample.num_seen_tokens :]
            sample.num_seen_tokens = req.num_output_tokens
            lp = step_lp.get(req.request_id)
            # No new token (a max_tokens=0 request finishing): its sample's logprobs are moot.
            if sample.logprobs is not None and lp is not None and new_tokens:
                sample.logprobs.append(lp)
                sample.cumulative_logprob += lp.logprob
            if new_tokens and _ends_on_stop_token(req):
                # Like vLLM: EOS / stop-token ids end the text without adding their own.
                new_tokens = new_tokens[:-1]
            detok = sample.detokenizer
            stop = detok.update(new_tokens) if new_tokens else None
            if stop is None and req.is_finished and not detok.finished:
                stop = detok.flush()  # text held back at the end may complete a stop string
            if stop is not None:
                stops.append((req, stop))
            else:
                self._drain_text(sample)
            touched[parent] = group
        return list(touched), stops

    def finalize_stop(self, sample_id: str) -> None:
        """Takes the text of a sample the scheduler has stopped on a stop string."""
        group = self.groups[self.parent_of[sample_id]]
        sample = next(s for s in group.samples if s.request.request_id == sample_id)
        self._drain_text(sample)

    def _drain_text(self, sample: SampleState) -> None:
        """Moves new text into `sample.text`; a finished sample's detokenizer is flushed
        (by `process`, or by its stop string)."""
        if sample.request.is_finished:
            sample.text = sample.detokenizer.output_text
        else:
            sample.text += sample.detokenizer.get_delta()

    def output_for(self, request_id: str) -> RequestOutput | None:
        group = self.groups.get(request_id)
        return group.to_output() if group else None


def _ends_on_stop_token(req: Request) -> bool:
    return (
        req.status == RequestStatus.FINISHED_STOPPED
        and not isinstance(req.stop_reason, str)
        and not req.sampling_params.include_stop_str_in_output
    )
