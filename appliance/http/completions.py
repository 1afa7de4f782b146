"""POST /v1/completions: text or token-id prompts (one or a batch), streamed or not.

Choices are numbered prompt-major: choice index = prompt index * n + sample index, as in
OpenAI's API. Streamed chunks carry text deltas (the engine's text only ever grows).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.http import convert
from appliance.http.body import read_json
from appliance.http.errors import bad_request, from_engine_error
from appliance.http.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from appliance.http.serving import (
    SSE_DONE,
    AppState,
    ClientGone,
    SSEResponse,
    collect,
    merged,
    sse,
    state_of,
    submit,
    until_disconnect,
)
from engine.outputs import RequestOutput
from engine.request_stream import RequestStream

logger = logging.getLogger("appliance.http")


def _prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    if any(isinstance(p, list) and not p for p in prompt):
        raise bad_request("prompt must not contain an empty token list", "prompt")
    return list(prompt)


async def create_completion(request: Request) -> Response:
    arrival = time.monotonic()
    state = state_of(request)
    req = await read_json(request, CompletionRequest, state.server.max_request_body)
    state.check_model(req.model)
    params = convert.sampling_params(req)
    prompts = _prompts(req.prompt)
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = await submit(
        state,
        prompts,
        params,
        rid,
        priority=req.priority,
        arrival_time=arrival,
        trace=(request, "text_completion"),
    )
    if req.stream:
        return SSEResponse(_stream(state, req, rid, prompts, streams), rid)
    try:
        finals = await until_disconnect(request, collect(streams), streams)
    except ClientGone:
        return Response(status_code=499)
    body = _response(state, req, rid, finals)
    _log_done(state, rid, finals)
    return JSONResponse(body.model_dump(mode="json"), headers={"X-Request-Id": rid})


def _response(
    state: AppState, req: CompletionRequest, rid: str, finals: list[RequestOutput]
) -> CompletionResponse:
    choices = []
    for p, out in enumerate(finals):
        prefix = _prompt_text(state, out.prompt or out.prompt_token_ids) if req.echo else ""
        for c in out.outputs:
            lps = None
            if req.logprobs is not None and c.logprobs is not None:
                lps = convert.completion_logprobs(c.logprobs, req.logprobs, state.token_str, 0)
            choices.append(
                CompletionChoice(
                    index=p * req.n + c.index,
                    text=prefix + c.text,
                    logprobs=lps,
                    finish_reason=convert.finish_reason(c.finish_reason),
                    stop_reason=c.stop_reason,
                )
            )
    return CompletionResponse(
        id=rid,
        created=int(time.time()),
        model=state.model_name,
        choices=choices,
        usage=convert.usage(finals),
    )


async def _stream(
    state: AppState,
    req: CompletionRequest,
    rid: str,
    prompts: list[str | list[int]],
    streams: list[RequestStream],
) -> AsyncIterator[str]:
    """SSE chunks: text deltas per choice, a final chunk per choice, usage, [DONE]."""
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent_text: dict[int, int] = {}
    sent_lps: dict[int, int] = {}
    finals: list[RequestOutput | None] = [None] * len(streams)

    def chunk(choices: list[CompletionChoice]) -> str:
        body = CompletionStreamResponse(
            object="text_completion",
            id=rid,
            created=created,
            model=state.model_name,
            choices=choices,
        )
        if include_usage:
            body.usage = None
        return sse(body.model_dump_json(exclude_unset=True))

    try:
        if req.echo:  # the prompt text first, once per choice
            yield chunk(
                [
                    CompletionChoice(
                        index=p * req.n + i,
                        text=_prompt_text(state, prompt),
                        logprobs=None,
                        finish_reason=None,
                    )
                    for p, prompt in enumerate(prompts)
                    for i in range(req.n)
                ]
            )
        async for p, out in merged(streams):
            finals[p] = out
            choices = []
            for c in out.outputs:
                idx = p * req.n + c.index
                delta = c.text[sent_text.get(idx, 0) :]
                sent_text[idx] = len(c.text)
                lps = None
                if req.logprobs is not None and c.logprobs is not None:
                    start = sent_lps.get(idx, 0)
                    lps = convert.completion_logprobs(
                        c.logprobs[start:],
                        req.logprobs,
                        state.token_str,
                        sent_text[idx] - len(delta),
                    )
                    sent_lps[idx] = len(c.logprobs)
                reason = convert.finish_reason(c.finish_reason)
                if delta or reason or (lps and lps.tokens):
                    choices.append(
                        CompletionChoice(
                            index=idx,
                            text=delta,
                            logprobs=lps,
                            finish_reason=reason,
                            stop_reason=c.stop_reason,
                        )
                    )
            if choices:
                yield chunk(choices)
        if include_usage:
            usage = convert.usage([f for f in finals if f is not None])
            body = CompletionStreamResponse(
                object="text_completion",
                id=rid,
                created=created,
                model=state.model_name,
                choices=[],
                usage=usage,
            )
            yield sse(body.model_dump_json())
        _log_done(state, rid, [f for f in finals if f is not None])
    except Exception as e:
        yield sse(json.dumps(from_engine_error(e).body()))
    yield SSE_DONE


def _prompt_text(state: AppState, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.aeng.tokenizer.decode(prompt)


def _log_done(state: AppState, rid: str, finals: list[RequestOutput]) -> None:
    fields = {
        "request_id": rid,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in finals),
        "completion_tokens": sum(len(c.token_ids) for o in finals for c in o.outputs),
        "finish_reasons": ",".join(str(c.finish_reason) for o in finals for c in o.outputs),
    }
    if state.server.log_prompts:
        fields["prompt"] = [o.prompt for o in finals]
        fields["output"] = [c.text for o in finals for c in o.outputs]
    logger.info("completion done", extra={"fields": fields})
