"""Between OpenAI's wire format and the engine's types: sampling params, logprobs, usage.

Everything here is pure (no I/O), so it is tested without a server.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from appliance import structured
from appliance.http.errors import APIError, bad_request, from_engine_error
from appliance.http.protocol import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogprobs,
    CompletionRequest,
    ErrorInfo,
    TopLogprob,
    UsageInfo,
)
from engine.core.step_io import TokenLogprobs
from engine.errors import UnsatisfiableRequestError
from engine.output.request_output import RequestOutput, SampleError
from engine.sampling_params import SamplingParams, SamplingParamsError

# JSON has no -inf; OpenAI clients expect a number.
_MIN_LOGPROB = -9999.0

TokenStr = Callable[[int], str]
MapParam = Callable[[str | None], str | None]


def json_logprob(x: float) -> float:
    """A logprob JSON can carry: -inf and NaN become -9999, as OpenAI sends them."""
    return _MIN_LOGPROB if math.isinf(x) or math.isnan(x) else max(x, _MIN_LOGPROB)


def sampling_params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """SamplingParams from either request kind; a bad value is a 400 naming the field."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens
        max_tokens_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
        logprobs = req.logprobs
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(
                "best_of other than n is not supported", "best_of", "unsupported_parameter"
            )
        prompt_logprobs = _prompt_logprobs(req)
    try:
        return SamplingParams(
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=req.stop_token_ids or (),  # SamplingParams makes the one set
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=req.logit_bias,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=c.params if (c := constraint(req)) else None,
        )
    except SamplingParamsError as e:
        param = max_tokens_param if e.param == "max_tokens" else e.param
        raise bad_request(f"{param}: {e.reason}", param) from None


def constraint(req: CompletionRequest | ChatCompletionRequest) -> structured.Constraint | None:
    """The structured-output constraint the request set, in any of its spellings (at most
    one); SamplingParamsError naming the field as the client wrote it."""
    given: list[structured.Given] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given.append(structured.Given("response_format", "json_object", True))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise SamplingParamsError(
                "is required when response_format.type is json_schema",
                "response_format.json_schema",
            )
        if rf.json_schema.schema_ is None:
            raise SamplingParamsError("is required", "response_format.json_schema.schema")
        given.append(
            structured.Given("response_format.json_schema.schema", "json", rf.json_schema.schema_)
        )
    if req.structured_outputs is not None:
        so = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        given += structured.from_object(so, "structured_outputs")
    for kind in ("json", "regex", "choice", "grammar"):
        if (value := getattr(req, f"guided_{kind}")) is not None:
            given.append(structured.Given(f"guided_{kind}", kind, value))
    return structured.build(given)


def _prompt_logprobs(req: CompletionRequest) -> int | None:
    """The engine's `prompt_logprobs` for a completion request; 400 for what we refuse.

    The echoed prompt is scored when `logprobs` is set, and always when `max_tokens` is 0
    (a request that only echoes: the engine runs it as a prompt-scoring request). Streamed,
    the prompt is echoed as text before its logprobs exist, so scoring it is refused."""
    if req.max_tokens == 0 and not req.echo:
        raise bad_request(
            "max_tokens: 0 is only allowed with echo: true (to score the prompt without "
            "generating)",
            "max_tokens",
        )
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs is not supported with stream: true",
            "prompt_logprobs",
            "unsupported_parameter",
        )
    if req.stream and req.echo and req.logprobs is not None:
        raise bad_request(
            "echo together with logprobs is not supported with stream: true",
            "echo",
            "unsupported_parameter",
        )
    asked = [req.prompt_logprobs] if req.prompt_logprobs is not None else []
    if req.echo and req.logprobs is not None:
        asked.append(req.logprobs)
    elif req.echo and req.max_tokens == 0:
        asked.append(0)
    return max(asked, default=None)


def engine_param(param: str | None, req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The engine says max_tokens; a chat request may have said max_completion_tokens."""
    if (
        param == "max_tokens"
        and isinstance(req, ChatCompletionRequest)
        and req.max_completion_tokens is not None
    ):
        return "max_completion_tokens"
    if param == "prompt" and isinstance(req, ChatCompletionRequest):
        return "messages"
    if param == "lora_request":  # the adapter the request's model selected
        return "model"
    if structured.is_engine_param(param):
        c = constraint(req)
        if c is None and isinstance(req, ChatCompletionRequest) and forces_a_call(req):
            return "tools"  # the grammar of a forced call is built from them
        return structured.client_field(param, c)
    return param


def forces_a_call(req: ChatCompletionRequest) -> bool:
    """tool_choice `required` or a named function (with tools): the answer is a call."""
    return bool(req.tools) and req.tool_choice not in (None, "none", "auto")


def finish_reason(reason: str | None) -> str | None:
    """Engine reasons to OpenAI's: stop and length pass, and "error" for a choice ended by
    its own constraints (its `error` says why); an abort never reaches a client."""
    if reason in (None, "stop", "length", "error"):
        return reason
    raise APIError(500, f"request ended with {reason}", "server_error", None, "engine_error")


def client_error(e: Exception, map_param: MapParam) -> APIError:
    """An engine error as the client's API error: `map_param` turns the engine's field
    name into the request's (a message starting with the engine's name is renamed too)."""
    err = from_engine_error(e)
    param = map_param(err.param)
    if err.param and param and param != err.param and err.message.startswith(f"{err.param}:"):
        err.message = param + err.message[len(err.param) :]
    err.param = param
    return err


def sample_error(err: SampleError) -> UnsatisfiableRequestError:
    """A sample's own failure as the error its whole answer would raise (a 400)."""
    return UnsatisfiableRequestError(err.message, err.param)


def choice_error(err: SampleError | None, map_param: MapParam) -> ErrorInfo | None:
    """A failed choice's `error` object: the body its 400 would carry (`client_error`)."""
    if err is None:
        return None
    api = client_error(sample_error(err), map_param)
    return ErrorInfo(message=api.message, type=api.type, param=api.param, code=api.code)


def usage(outs: Sequence[RequestOutput]) -> UsageInfo:
    """The usage of finished requests."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outs if o.metrics is not None)
    return usage_info(prompt, completion, cached)


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    """OpenAI's usage object (also the running one of `continuous_usage_stats`)."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details={"cached_tokens": cached_tokens},
    )


def chat_logprobs(lps: Sequence[TokenLogprobs], num_top: int, token_str: TokenStr) -> ChatLogprobs:
    content = []
    for lp in lps:
        tok = token_str(lp.token_id)
        top = [
            TopLogprob(token=(s := token_str(t)), logprob=json_logprob(v), bytes=list(s.encode()))
            for t, v in lp.top[:num_top]
        ]
        content.append(
            ChatLogprobToken(
                token=tok,
                logprob=json_logprob(lp.logprob),
                bytes=list(tok.encode()),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    lps: Sequence[TokenLogprobs], num_top: int, token_str: TokenStr, offset: int
) -> CompletionLogprobs:
    """Legacy format; `offset` is the text offset of the first token (for streamed deltas).

    Every field is passed to the constructor: stream chunks are dumped with exclude_unset,
    which would drop lists filled in after construction."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for lp in lps:
        tok = token_str(lp.token_id)
        tokens.append(tok)
        token_logprobs.append(json_logprob(lp.logprob))
        top = {token_str(t): json_logprob(v) for t, v in lp.top[:num_top]}
        top.setdefault(tok, json_logprob(lp.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(tok)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
        text_offset=text_offset,
    )  # fmt: skip
