"""POST /v1/chat/completions: the model's chat template, then one engine request.

Streaming follows OpenAI's shape: a first chunk per choice with `delta.role`, content
deltas, a last chunk per choice with `finish_reason`, an optional usage chunk with no
choices (`stream_options.include_usage`), then `data: [DONE]`.

Tools and reasoning (appliance/dialect): the template gets `tools=` (or the fallback system
prompt), each choice's text is split into `reasoning_content`, `content` and `tool_calls`,
and a `tool_choice` that forces a call becomes a grammar constraint on the engine request.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from appliance.dialect.chat_output import (
    ChatDialect,
    ChoiceStream,
    DialectError,
    chat_dialect,
    constrain,
    finish_reason,
    for_prompt,
    parse_choice,
)
from appliance.dialect.prompt import render_messages
from appliance.dialect.tools_prompt import template_text
from appliance.http import convert
from appliance.http.caller import caller_of
from appliance.http.errors import bad_request, from_engine_error
from appliance.http.middleware import cache_salt_of
from appliance.http.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatMessageOut,
    ChoiceDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
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
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Plain dicts for the template; text parts joined, `developer` read as `system`."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise bad_request(
                        f"only text content parts are supported, got {part.type!r}",
                        f"messages.{i}.content.{j}.type",
                        "unsupported_parameter",
                    )
                if part.text is None:
                    raise bad_request(
                        "a text content part needs a `text` string",
                        f"messages.{i}.content.{j}.text",
                        "missing_required_parameter",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        if m.role == "tool" and content is None:
            # A tool's answer is its content (OpenAI requires it); checked here, where chat,
            # its render route and /tokenize all read messages, so they answer alike.
            raise bad_request(
                "a tool message needs `content` (the tool's result)",
                f"messages.{i}.content",
                "missing_required_parameter",
            )
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        out.append(msg)
    return out


def render_chat(
    state: AppState,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """Prompt token ids from the model's chat template (appliance/dialect/prompt.py);
    template failures are a 400."""
    try:
        return render_messages(
            state.aeng.tokenizer,
            messages_to_dicts(messages),
            tools,
            add_generation_prompt,
            continue_final_message,
            template_kwargs,
        )
    except DialectError as e:
        raise bad_request(str(e), e.param, e.code) from None


def dialect_of(state: AppState, req: ChatCompletionRequest) -> ChatDialect:
    """The request's tools, tool_choice and reasoning under the server's parsers; a 400
    naming the field when they cannot be served."""
    kwargs = req.chat_template_kwargs or {}
    try:
        return chat_dialect(
            [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            req.tool_choice
            if isinstance(req.tool_choice, str | None)
            else (req.tool_choice.model_dump()),
            req.parallel_tool_calls,
            state.server.tool_parser,
            state.server.reasoning_parser,
            template_text(state.aeng.tokenizer),
            enable_thinking=kwargs.get("enable_thinking", True) is not False,
        )
    except DialectError as e:
        raise bad_request(str(e), e.param) from None


def checked_prompt_ids(
    state: AppState, req: ChatCompletionRequest, params: SamplingParams
) -> tuple[ChatDialect, list[int]]:
    """The request's dialect and its rendered prompt ids, after the dialect's checks (tools,
    reasoning) constrained `params`: what generation and the render route both need. Work
    in proportion to the request (its tools, messages, schemas): run it with
    `Begun.offload`."""
    dialect = dialect_of(state, req)
    prompt_ids = render_chat(
        state, req.messages, req.add_generation_prompt, req.continue_final_message,
        req.chat_template_kwargs, dialect.tools,
    )  # fmt: skip
    dialect = for_prompt(dialect, state.aeng.tokenizer, prompt_ids)
    try:
        constrain(params, dialect)
    except DialectError as e:
        raise bad_request(str(e), e.param) from None
    return dialect, prompt_ids


async def create_chat_completion(request: Request) -> Response:
    begun = await begin(request, ChatCompletionRequest)
    state, req, params = begun.state, begun.req, begun.params
    dialect, prompt_ids = await begun.offload(checked_prompt_ids, state, req, params)
    rid = f"chatcmpl-{uuid.uuid4().hex}"

    def map_param(p: str | None) -> str | None:
        return convert.engine_param(p, req)

    streams = await submit(
        request, begun, [prompt_ids], rid, "chat", map_param=map_param,
        cache_salt=cache_salt_of(request.scope, req.cache_salt, state.server.cache_salt_by_api_key),
        caller=caller_of(request, state, begun.arrival),
    )  # fmt: skip
    events = _stream(state, req, dialect, rid, streams, map_param) if req.stream else None
    return await respond(
        request, rid, streams, events,
        lambda f: _response(state, req, dialect, rid, f[0], map_param), map_param,
    )  # fmt: skip


def _num_top(req: ChatCompletionRequest) -> int:
    return req.top_logprobs or 0


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's reason; an answer that ends in tool calls finishes with `tool_calls`."""
    return finish_reason(convert.finish_reason(reason), called)


def _response(
    state: AppState,
    req: ChatCompletionRequest,
    dialect: ChatDialect,
    rid: str,
    out: RequestOutput,
    map_param: convert.MapParam,
) -> ChatCompletionResponse:
    """The non-streamed answer; logs the request as done."""
    choices = []
    for c in out.outputs:
        lps = None
        if req.logprobs and c.logprobs is not None:
            lps = convert.chat_logprobs(c.logprobs, _num_top(req), state.token_str)
        parsed = parse_choice(dialect, c.text, cut=c.finish_reason == "length")
        if parsed.dropped:
            _drop_cut_calls(state, rid, c.index, parsed.dropped, c.finish_reason or "")
        calls = [
            ToolCallOut(id=t.id, function=FunctionCallOut(name=t.name, arguments=t.arguments))
            for t in parsed.tool_calls
        ]
        choices.append(
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(
                    content=parsed.content, reasoning_content=parsed.reasoning, tool_calls=calls
                ),
                logprobs=lps,
                finish_reason=_finish_reason(c.finish_reason, bool(calls)),
                stop_reason=c.stop_reason,
                error=convert.choice_error(c.error, map_param),
            )
        )
    body = whole_body(
        ChatCompletionResponse, rid, state.response_model(req.model), choices, convert.usage([out])
    )
    _log_done(state, rid, req, out)
    return body


def _drop_cut_calls(state: AppState, rid: str, index: int, dropped: int, reason: str) -> None:
    """A choice ended inside a tool call (at max_tokens, mostly): its complete calls are
    answered as tool_calls and the cut one is left out; logged and counted
    (`appliance_tool_calls_dropped_total`) so that it is not silent."""
    state.metrics.tool_calls_dropped.labels(reason).inc(dropped)
    logger.warning(
        "tool call cut short was dropped",
        extra={"fields": {"request_id": rid, "index": index, "dropped": dropped,
                          "finish_reason": reason}},
    )  # fmt: skip


def _delta(d) -> ChoiceDelta:  # noqa: ANN001 - appliance.dialect.chat_output.ChoiceDelta
    """A chunk's delta from a dialect piece, with only the fields that carry something."""
    kw: dict = {}
    if d.reasoning:
        kw["reasoning_content"] = d.reasoning
    if d.content:
        kw["content"] = d.content
    if d.tool_calls:
        kw["tool_calls"] = [
            ToolCallDelta(
                index=t.index,
                function=FunctionCallOut(name=t.name, arguments=t.arguments),
                **({"id": t.id, "type": "function"} if t.id else {}),
            )
            if t.id
            else ToolCallDelta(index=t.index, function=FunctionCallOut(arguments=t.arguments))
            for t in d.tool_calls
        ]
    return ChoiceDelta(**kw)


async def _stream(
    state: AppState,
    req: ChatCompletionRequest,
    dialect: ChatDialect,
    rid: str,
    streams: list[RequestStream],
    map_param: convert.MapParam,
) -> AsyncIterator[str]:
    w = ChunkWriter(
        ChatCompletionChunk, rid, state.response_model(req.model), req.stream_options, streams
    )
    parsers = [ChoiceStream(dialect) for _ in range(req.n)]
    try:
        yield w.chunk(
            [
                ChatChunkChoice(
                    index=i, delta=ChoiceDelta(role="assistant", content=""), logprobs=None,
                    finish_reason=None,
                )
                for i in range(req.n)
            ]
        )  # fmt: skip
        async for _, delta in merged(streams):
            w.took(delta)
            choices, ends = [], []
            for c in delta.outputs:
                lps = None
                if req.logprobs and c.logprobs:
                    lps = convert.chat_logprobs(c.logprobs, _num_top(req), state.token_str)
                p = parsers[c.index]
                piece = p.step(c.text, c.finish_reason is not None, c.finish_reason == "length")
                if p.dropped:
                    _drop_cut_calls(state, rid, c.index, p.dropped, c.finish_reason or "")
                    p.dropped = 0
                delta = _delta(piece) if piece else ChoiceDelta()
                reason = _finish_reason(c.finish_reason, p.called)
                if reason and piece is not None and piece.tool_calls:
                    # The openai SDK's stream helper closes a call (its `arguments.done`)
                    # when the next call or a finish chunk comes, and reads a chunk's finish
                    # before its calls: a finish sent with the last call would leave that
                    # call open. OpenAI sends the finish alone; so does this.
                    choices.append(
                        ChatChunkChoice(
                            index=c.index, delta=delta, logprobs=lps, finish_reason=None
                        )
                    )
                    delta, lps = ChoiceDelta(), None
                    target = ends
                else:
                    target = choices
                if delta.model_fields_set or reason or lps:
                    failed = {"error": convert.choice_error(c.error, map_param)} if c.error else {}
                    target.append(
                        ChatChunkChoice(
                            index=c.index,
                            delta=delta,
                            logprobs=lps,
                            finish_reason=reason,
                            **({"stop_reason": c.stop_reason} if reason else {}),
                            **failed,
                        )
                    )
            if choices:
                yield w.chunk(choices)
            if ends:
                yield w.chunk(ends)
        final = streams[0].output()
        if w.include_usage:
            yield w.usage(convert.usage([final]))
        _log_done(state, rid, req, final)
    except Exception as e:
        yield sse(json.dumps(from_engine_error(e).body()))
    yield SSE_DONE


def _log_done(state: AppState, rid: str, req: ChatCompletionRequest, out: RequestOutput) -> None:
    log_done(
        state, rid, [out], "chat completion", "messages", lambda: messages_to_dicts(req.messages)
    )
