"""Beam search on top of the engine, one token per round for every live beam.

Each round submits one single-token request per live beam (greedy, with the top 2*width
logprobs). The beams of a prompt share their common prefix through the prefix cache: the
full blocks they have in common are the same physical blocks, held by ref count, and a beam
that is pruned simply stops referencing them, so they return to the free queue.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError, RequestFailedError
from engine.output.request_output import OutputAccumulator, RequestOutput
from engine.sampling_params import BeamSearchParams, SamplingParams

_MAX_LOGPROBS = 20


@dataclass
class BeamSequence:
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    cumulative_logprob: float = 0.0
    finished: bool = False
    text: str = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def score(self, length_penalty: float) -> float:
        length = max(1, len(self.output_token_ids))
        return self.cumulative_logprob / (length**length_penalty)


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)  # best first


def run_beam_search(engine, prompts: list, params: BeamSearchParams, ids: itertools.count):
    width = params.beam_width
    if 2 * width > _MAX_LOGPROBS:
        raise InvalidRequestError(f"beam_width must be at most {_MAX_LOGPROBS // 2}", "beam_width")
    eos = engine.tokenizer.eos_token_ids
    outputs = []
    for prompt in prompts:
        _, prompt_ids = engine.tokenize_prompt(prompt)
        outputs.append(_search_one(engine, prompt_ids, params, eos, ids))
    return outputs


def _search_one(engine, prompt_ids: list[int], params: BeamSearchParams, eos, ids):
    width = params.beam_width
    live = [BeamSequence(list(prompt_ids), len(prompt_ids))]
    done: list[BeamSequence] = []
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    for _ in range(params.max_tokens):
        tops = _expand(engine, live, step_params, ids)
        candidates = []
        for beam, top in zip(live, tops, strict=True):
            for token_id, logprob in top:
                candidates.append((beam.cumulative_logprob + logprob, beam, token_id))
        candidates.sort(key=lambda c: c[0], reverse=True)
        live = []
        for cum, beam, token_id in candidates:
            seq = BeamSequence([*beam.token_ids, token_id], beam.num_prompt_tokens, cum)
            if token_id in eos and not params.ignore_eos:
                seq.finished = True
                done.append(seq)
            else:
                live.append(seq)
            if len(live) == width:
                break
        if not live:
            break
    pool = done + live
    pool.sort(key=lambda s: s.score(params.length_penalty), reverse=True)
    best = pool[:width]
    for seq in best:
        seq.text = engine.tokenizer.decode(seq.output_token_ids)
    return BeamSearchOutput(list(prompt_ids), best)


def _expand(engine, beams: list[BeamSequence], params: SamplingParams, ids):
    """One round: each beam's top-2w next tokens with their logprobs."""
    pending: dict[str, OutputAccumulator] = {}
    for beam in beams:
        rid = f"beam-{next(ids)}"
        engine.add_request(rid, {"prompt_token_ids": beam.token_ids}, params)
        pending[rid] = OutputAccumulator(rid, 1)
    results: dict[str, RequestOutput] = {}
    while len(results) < len(pending):
        for delta in engine.step():
            acc = pending[delta.request_id]
            acc.add(delta)
            if delta.finished:
                results[delta.request_id] = acc.output()
    tops = []
    for rid in pending:
        out = results[rid]
        if out.error:
            raise RequestFailedError(out.error)
        lp = out.outputs[0].logprobs[0]
        tops.append(lp.top or [(lp.token_id, lp.logprob)])
    return tops
