"""The Responses API's bodies as pydantic models: the request (exactly the HONORED and IGNORED
rows of `fields.FIELDS`), the input items it may hold, and the Response object with its
output items, in OpenAI's shapes (openai's `types/responses` is the reference).

The request is strict and forbids unknown fields, as the chat models do. Input items are
lenient about fields they do not read (`extra="ignore"`): clients send back the output
items of a previous response as input, and those carry fields (status, annotations,
logprobs, phase, ...) that grow with each SDK release.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

IGNORED = "Accepted for compatibility and ignored (docs/responses.md)."


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ResponseBody(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- request ------------------------------------------------------------------------------
class TextFormat(_Request):
    """`text.format`: text, json_object, or json_schema (name, schema, description, strict)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = Field(None, description="The schema is always enforced.")


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description=IGNORED)


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="none: thinking off in the template; the others change nothing."
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(None, description=IGNORED)
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description=IGNORED
    )
    context: Literal["auto", "current_turn", "all_turns"] | None = Field(None, description=IGNORED)
    mode: str | None = Field(None, description=IGNORED)


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = Field(None, description=IGNORED)


class ResponsesRequest(_Request):
    """`POST /v1/responses` (docs/responses.md: what each field does here)."""

    # honored
    input: str | list[dict[str, Any]] = Field(
        description="A string, or message / function_call / function_call_output / reasoning items."
    )
    instructions: str | None = None
    model: str | None = Field(None, description="Served model name; defaults to the one model.")
    max_output_tokens: int | None = Field(None, ge=1, description="null: up to the context.")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools only.")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = Field(None, description="At most 16 pairs.")
    user: str | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = Field(True, description="Keep the response (default true).")
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = Field(None, description="auto is refused.")
    # ignored
    safety_identifier: str | None = Field(None, description=IGNORED)
    prompt_cache_key: str | None = Field(None, description=IGNORED)
    prompt_cache_retention: str | None = Field(None, description=IGNORED)
    prompt_cache_options: dict[str, Any] | None = Field(None, description=IGNORED)
    service_tier: str | None = Field(None, description=IGNORED)
    max_tool_calls: int | None = Field(None, ge=1, description=IGNORED)
    image: dict[str, Any] | None = Field(None, description=IGNORED)
    access_programs: dict[str, Any] | None = Field(None, description=IGNORED)
    # vLLM's extensions
    cache_salt: str | None = Field(None, min_length=1, description="Prefix-cache isolation.")
    priority: int = Field(0, description="Lower runs first with scheduler.policy=priority.")
    seed: int | None = None
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)


class FunctionToolIn(_Request):
    """A `tools` entry of type function (the Responses shape: name at the top level)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    output_schema: dict[str, Any] | None = Field(None, description=IGNORED)
    defer_loading: bool | None = Field(None, description="Only false (or null).")


# ---- input items (validated one by one in items.py, errors naming input.N) -------------------
class InputPart(_Item):
    type: str
    text: str | None = None
    refusal: str | None = None


class MessageIn(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]
    id: str | None = None


class FunctionCallIn(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None


class FunctionCallOutputIn(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputPart]
    id: str | None = None


class ReasoningPart(_Item):
    type: str
    text: str


class ReasoningIn(_Item):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None


# ---- output items and the Response object ------------------------------------------------
class OutputTextLogprob(ResponseBody):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputText(ResponseBody):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputTextLogprob] = Field(default_factory=list)


class MessageItem(ResponseBody):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(ResponseBody):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class ReasoningText(ResponseBody):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(ResponseBody):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(ResponseBody):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(ResponseBody):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseBody):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(ResponseBody):
    code: str
    message: str


class IncompleteDetails(ResponseBody):
    reason: Literal["max_output_tokens"]


class ResponseObject(ResponseBody):
    """The Response (`object: response`), as returned, streamed and stored."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float
    top_p: float
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any]
    top_logprobs: int = 0
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    background: bool = False
    service_tier: str = "default"
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    completed_at: int | None = None


class DeletedResponse(ResponseBody):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: Literal[True] = True


class InputTokens(ResponseBody):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class InputItemList(ResponseBody):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
