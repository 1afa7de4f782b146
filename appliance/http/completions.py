"""POST /v1/completions: text or token-id prompts (one or a batch), streamed or not.

Choices are numbered prompt-major: choice index = prompt index * n + sample index, as in
OpenAI's API. Streamed chunks carry the engine's deltas: each choice's new text (and
logprobs) as it comes, its finish_reason once. The prompt's side (`echo` with `logprobs`,
`prompt_logprobs`, `max_tokens` 0) is in `echo`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from appliance.http import convert, echo
from appliance.http.caller import caller_of
from appliance.http.errors import bad_request, from_engine_error
from appliance.http.middleware import cache_salt_of
from appliance.http.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from appliance.http.serving import (
    SSE_DONE,
    AppState,
    ChunkWriter,
    begin,
    log_done,
    merged,
    respond,
    sse,
    submit,
    whole_body,
)
from engine.output.request_output import RequestOutput
from engine.request_stream import RequestStream


def prompts_of(prompt: str | list) -> list[str | list[int]]:
    """The prompts of a completion request: one text or token list, or a batch of them."""
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
    begun = await begin(request, CompletionRequest)
    state, req = begun.state, begun.req
    prompts = prompts_of(req.prompt)
    rid = f"cmpl-{uuid.uuid4().hex}"

    def map_param(p: str | None) -> str | None:
        return convert.engine_param(p, req)

    streams = await submit(
        request, begun, prompts, rid, "text_completion", map_param=map_param,
        cache_salt=cache_salt_of(request.scope, req.cache_salt, state.server.cache_salt_by_api_key),
        caller=caller_of(request, state, begun.arrival),
    )  # fmt: skip
    events = _stream(state, req, rid, prompts, streams, map_param) if req.stream else None
    return await respond(
        request, rid, streams, events, lambda f: _response(state, req, rid, f, map_param),
        map_param,
    )  # fmt: skip


def _response(
    state: AppState,
    req: CompletionRequest,
    rid: str,
    finals: list[RequestOutput],
    map_param: convert.MapParam,
) -> CompletionResponse:
    """The non-streamed answer; logs the request as done."""
    choices = []
    for p, out in enumerate(finals):
        prefix = _prompt_text(state, out.prompt or out.prompt_token_ids) if req.echo else ""
        prompt_lps = echo.prompt_logprobs_field(req, out, state.token_str)
        for c in out.outputs:
            choices.append(
                CompletionChoice(
                    index=p * req.n + c.index,
                    text=prefix + c.text,
                    logprobs=echo.choice_logprobs(req, out, c, prefix, state.token_str),
                    finish_reason=convert.finish_reason(c.finish_reason),
                    stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_lps,
                    error=convert.choice_error(c.error, map_param),
                )
            )
    body = whole_body(
        CompletionResponse, rid, state.response_model(req.model), choices, convert.usage(finals)
    )
    _log_done(state, rid, finals)
    return body


async def _stream(
    state: AppState,
    req: CompletionRequest,
    rid: str,
    prompts: list[str | list[int]],
    streams: list[RequestStream],
    map_param: convert.MapParam,
) -> AsyncIterator[str]:
    """SSE chunks: text deltas per choice, a final chunk per choice (a failed choice's with
    finish_reason "error" and its `error`), usage, [DONE]."""
    w = ChunkWriter(
        CompletionStreamResponse, rid, state.response_model(req.model), req.stream_options, streams
    )
    try:
        if req.echo:  # the prompt text first, once per choice
            yield w.chunk(
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
        async for p, delta in merged(streams):
            w.took(delta)
            choices = []
            for c in delta.outputs:
                idx = p * req.n + c.index
                offset = w.text_offset(idx, c.text)
                lps = None
                if req.logprobs is not None and c.logprobs:
                    lps = convert.completion_logprobs(
                        c.logprobs, req.logprobs, state.token_str, offset
                    )
                reason = convert.finish_reason(c.finish_reason)
                if c.text or reason or lps:
                    failed = {"error": convert.choice_error(c.error, map_param)} if c.error else {}
                    choices.append(
                        CompletionChoice(
                            index=idx,
                            text=c.text,
                            logprobs=lps,
                            finish_reason=reason,
                            stop_reason=c.stop_reason,
                            **failed,
                        )
                    )
            if choices:
                yield w.chunk(choices)
        finals = [s.output() for s in streams]
        if w.include_usage:
            yield w.usage(convert.usage(finals))
        _log_done(state, rid, finals)
    except Exception as e:
        yield sse(json.dumps(from_engine_error(e).body()))
    yield SSE_DONE


def _prompt_text(state: AppState, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.aeng.tokenizer.decode(prompt)


def _log_done(state: AppState, rid: str, finals: list[RequestOutput]) -> None:
    log_done(state, rid, finals, "completion", "prompt", lambda: [o.prompt for o in finals])
