"""One `POST /v1/responses` made ready for the engine: the conversation (a previous response's
items, then this input), its chat messages, tools and dialect, and the sampling parameters.

Everything that reads request fields lives here, so HTTP and gRPC refuse the same values
with the same field paths. The chat path's pieces do the work: `chat_dialect` and
`constrain` (tools, tool_choice, reasoning), `structured.build` (text.format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pydantic

from appliance import structured
from appliance.dialect.chat_output import ChatDialect, DialectError, chat_dialect, constrain
from appliance.responses.errors import ResponsesError
from appliance.responses.items import canonical_items, to_messages
from appliance.responses.protocol import FunctionToolIn, ResponsesRequest
from appliance.responses.store import StoredResponse
from engine.sampling_params import SamplingParams, SamplingParamsError

LOGPROBS = "message.output_text.logprobs"
ENCRYPTED_REASONING = "reasoning.encrypted_content"
# include values that name outputs of built-in tools or images, which never occur here.
_NOTHING_TO_INCLUDE = frozenset(
    {
        "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
        "message.input_image.image_url", "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)  # fmt: skip
_TOOL_CHOICE_MODES = ("none", "auto", "required")
_METADATA_MAX = (16, 64, 512)  # pairs, key characters, value characters


@dataclass(frozen=True)
class Parsers:
    """The server's parsers (`server.tool_parser`, `server.reasoning_parser`)."""

    tool_parser: str = "auto"
    reasoning_parser: str = "none"


@dataclass(frozen=True)
class Turn:
    """A checked request, ready to render and submit."""

    request: ResponsesRequest
    input_items: list[dict]  # the whole conversation so far, canonical (what input_items lists)
    messages: list[dict]  # chat messages: instructions first
    tools: list[dict] | None  # function tools in the chat shape (what the template gets)
    dialect: ChatDialect
    params: SamplingParams
    template_kwargs: dict[str, Any]
    logprobs: int | None  # alternatives per token when logprobs were asked for
    encrypt_reasoning: bool
    constraint: structured.Constraint | None

    def client_param(self, param: str | None) -> str | None:
        """The request field an engine error's param names (its `max_tokens` is
        max_output_tokens, its `structured_outputs` text.format or a forced tool call)."""
        if param == "max_tokens":
            return "max_output_tokens"
        if param in ("prompt", "messages"):
            return "input"
        if param == "lora_request":
            return "model"
        if structured.is_engine_param(param):
            if self.constraint is None and self.dialect.forced:
                return "tool_choice"
            return structured.client_field(param, self.constraint)
        return param


def plan_turn(
    req: ResponsesRequest,
    previous: StoredResponse | None,
    parsers: Parsers,
    template: str | None,
) -> Turn:
    """The turn of `req` continuing `previous` (None: a new conversation); ResponsesError
    naming the field for what cannot be served."""
    _check_fields(req)
    include = _include(req.include)
    new = canonical_items(req.input)
    before = previous.conversation() if previous is not None else []
    items = before + new
    paths = ["previous_response_id"] * len(before) + [f"input.{i}" for i in range(len(new))]
    messages = to_messages(items, paths)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    tools = _tools(req.tools)
    thinking = req.reasoning is None or req.reasoning.effort != "none"
    try:
        dialect = chat_dialect(
            tools, _tool_choice(req.tool_choice), req.parallel_tool_calls,
            parsers.tool_parser, parsers.reasoning_parser, template, enable_thinking=thinking,
        )  # fmt: skip
    except DialectError as e:
        raise ResponsesError(str(e), e.param, e.code) from None
    logprobs = None
    if LOGPROBS in include or (req.top_logprobs or 0) > 0:
        if dialect.tool_parser is not None or dialect.reasoning_parser is not None:
            raise ResponsesError(
                f"{LOGPROBS} is served only without tools and without a reasoning parser "
                "(logprobs are per token, and the parsers split the text between items)",
                "include",
            )
        logprobs = req.top_logprobs or 0
    # A forced call is the whole answer of this turn: text.format has no text to shape (an
    # agent sends its output type on every turn, tool_choice required included).
    constraint, params = _sampling(req, logprobs, use_format=not dialect.forced)
    try:
        constrain(params, dialect)
    except DialectError as e:
        raise ResponsesError(str(e), e.param, e.code) from None
    return Turn(
        request=req, input_items=items, messages=messages, tools=tools, dialect=dialect,
        params=params, template_kwargs={} if thinking else {"enable_thinking": False},
        logprobs=logprobs, encrypt_reasoning=ENCRYPTED_REASONING in include,
        constraint=constraint,
    )  # fmt: skip


def _check_fields(req: ResponsesRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise ResponsesError("stream_options is only allowed when stream is true", "stream_options")
    if req.truncation == "auto":
        raise ResponsesError(
            "truncation 'auto' is not served: an input over the context is refused (400) "
            "rather than cut",
            "truncation",
            "unsupported_parameter",
        )
    if (req.prompt_cache_options or {}).get("prewarm") is True:
        raise ResponsesError(
            "prewarming the prompt cache is not served", "prompt_cache_options.prewarm",
            "unsupported_parameter",
        )  # fmt: skip
    pairs, key_max, value_max = _METADATA_MAX
    meta = req.metadata or {}
    if len(meta) > pairs:
        raise ResponsesError(f"metadata holds at most {pairs} pairs", "metadata")
    for k, v in meta.items():
        if len(k) > key_max or len(v) > value_max:
            raise ResponsesError(
                f"metadata keys are at most {key_max} characters and values {value_max}",
                f"metadata.{k[:key_max]}",
            )


def _include(values: list[str] | None) -> set[str]:
    known = {LOGPROBS, ENCRYPTED_REASONING} | _NOTHING_TO_INCLUDE
    for i, v in enumerate(values or []):
        if v not in known:
            raise ResponsesError(f"unknown include value {v!r:.80}", f"include.{i}")
    return set(values or [])


def _tools(raw: list[dict[str, Any]] | None) -> list[dict] | None:
    """Function tools in the chat shape; any other tool type is refused, naming it."""
    out = []
    for i, t in enumerate(raw or []):
        kind = t.get("type")
        if kind != "function":
            raise ResponsesError(
                f"tool type {kind!r:.40} is not served: built-in tools (web search, file search, "
                "computer use, code interpreter, MCP, ...) run only at OpenAI; declare a "
                "function tool instead",
                f"tools.{i}.type",
                "unsupported_parameter",
            )
        try:
            tool = FunctionToolIn.model_validate(t, strict=True)
        except pydantic.ValidationError as e:
            err = e.errors(include_url=False)[0]
            where = ".".join(str(p) for p in (f"tools.{i}", *err["loc"]))
            raise ResponsesError(f"Invalid value for '{where}': {err['msg']}", where) from None
        if tool.defer_loading:
            raise ResponsesError(
                "deferred tool loading is not served", f"tools.{i}.defer_loading",
                "unsupported_parameter",
            )  # fmt: skip
        fn: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            fn["description"] = tool.description
        if tool.parameters is not None:
            fn["parameters"] = tool.parameters
        if tool.strict is not None:
            fn["strict"] = tool.strict
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict | None:
    """The chat shape of `tool_choice`: a mode, or {type: function, function: {name}}."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise ResponsesError(
                "a function tool_choice needs a `name`", "tool_choice.name",
                "missing_required_parameter",
            )  # fmt: skip
        return {"type": "function", "function": {"name": name}}
    raise ResponsesError(
        f"tool_choice type {kind!r:.40} is not served; use none, auto, required or "
        "{type: function, name}",
        "tool_choice.type",
        "unsupported_parameter",
    )


def _sampling(
    req: ResponsesRequest, logprobs: int | None, use_format: bool
) -> tuple[structured.Constraint | None, SamplingParams]:
    try:
        given = _given(req)
        constraint = structured.build(given) if use_format else None
        params = SamplingParams(
            n=1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            ignore_eos=req.ignore_eos,
            max_tokens=req.max_output_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            structured_outputs=constraint.params if constraint else None,
        )
    except SamplingParamsError as e:
        param = "max_output_tokens" if e.param == "max_tokens" else e.param
        raise ResponsesError(f"{param}: {e.reason}", param) from None
    return constraint, params


def _given(req: ResponsesRequest) -> list[structured.Given]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [structured.Given("text.format", "json_object", True)]
    if fmt.schema_ is None:
        raise SamplingParamsError("is required when text.format.type is json_schema",
                                  "text.format.schema")  # fmt: skip
    if not fmt.name:
        raise SamplingParamsError("is required when text.format.type is json_schema",
                                  "text.format.name")  # fmt: skip
    return [structured.Given("text.format.schema", "json", fmt.schema_)]
