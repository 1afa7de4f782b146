"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Request models are strict (no "5" for 5, no 1 for true) and forbid unknown fields, so a
typo or an unsupported OpenAI parameter is a 400 naming the field rather than a silent
no-op. A few OpenAI fields that change nothing here are declared and documented as
accepted-and-ignored (`user`, `store`, `metadata`, `service_tier`).
Fields we do not implement but clients commonly send (`functions`, `audio`, ...) are
refused explicitly by `body.check_unsupported` before validation, unless their value is
the harmless default. The same models generate /openapi.json.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, RootModel

IGNORED = "Accepted for compatibility and ignored."


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- shared pieces -----------------------------------------------------------------------
class ErrorInfo(ResponseModel):
    """OpenAI's error object: the body of every error, and a failed choice's `error`."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


# A choice's finish: OpenAI's, and "error" for a choice ended by its own constraints (its
# `error` says why; docs/serving.md, "Errors").
TextFinish = Literal["stop", "length", "error"]
ChatFinish = Literal["stop", "length", "tool_calls", "error"]


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# ---- structured outputs (appliance.structured turns these into the engine's params) --------
class JsonSchemaFormat(RequestModel):
    """OpenAI's `response_format.json_schema`."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON Schema.")
    strict: bool | None = Field(
        None, description="Accepted; the schema is always enforced, strict or not."
    )


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema.")


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs`: exactly one kind."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON Schema.")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="A grammar in llguidance's Lark dialect.")


class SamplingFields(RequestModel):
    """Sampling fields common to completions and chat (OpenAI + vLLM extras)."""

    model: str | None = Field(None, description="Served model name; defaults to the one model.")
    n: int = Field(1, ge=1, description="Samples per prompt (at most scheduler.max_n).")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(
        None,
        description="Stop strings: at most scheduler.max_stop_strings (16), each at most scheduler.max_stop_string_chars (1024) characters.",
    )
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100]."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description=IGNORED)
    # vLLM extras
    top_k: int = Field(-1, ge=-1, description="-1 or 0: disabled.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, description="Lower runs first with scheduler.policy=priority.")
    cache_salt: str | None = Field(
        None,
        min_length=1,
        description="Prefix-cache isolation: only requests with the same salt share cached "
        "prompt blocks (and cached_tokens). With server.cache_salt_by_api_key the server adds "
        "the caller's API key.",
    )
    # structured outputs: at most one of these (see docs/serving.md)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = Field(
        None, description="Alias of structured_outputs.json."
    )
    guided_regex: str | None = Field(None, description="Alias of structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="Alias of structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="Alias of structured_outputs.grammar.")


# ---- completions -------------------------------------------------------------------------
Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description="Text, token ids, or a batch of either.")
    max_tokens: int | None = Field(
        16, ge=0, description="null: up to the context length; 0 only with echo (score the prompt)."
    )
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, description="Only equal to n is supported.")
    # vLLM extra
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="Top alternatives per prompt token (vLLM's format)."
    )


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """One candidate at one prompt position, as vLLM returns `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: TextFinish | None = None
    stop_reason: int | str | None = None
    # Per prompt token (the first is null): token id (as a string) -> its candidate entry.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    error: ErrorInfo | None = Field(None, description='With finish_reason "error": why.')


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionEnvelope(ResponseModel):
    """The fields every completion response and stream chunk starts with, in wire order.

    Shared so the four response bodies cannot drift apart; each subclass narrows `object`
    and `choices` (a redeclared field keeps its place, so the JSON key order is unchanged).
    """

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: UsageInfo | None = None


class CompletionResponse(CompletionEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None


# ---- chat --------------------------------------------------------------------------------
class ContentPart(BaseModel):
    """A content part; only `{"type": "text", "text": ...}` is supported (checked later)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


# The chat roles every frontend accepts (native gRPC reads them from here too).
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)


# ---- tools (OpenAI's function tools; read by appliance/dialect) ---------------------------
class FunctionDef(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments.")
    strict: bool | None = Field(
        None,
        description="Arguments always follow the schema with "
        "tool_choice required or named; under auto they are parsed.",
    )


class ToolDef(RequestModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(RequestModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON string.")


class ToolCallIn(RequestModel):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated alias.")
    max_completion_tokens: int | None = Field(None, ge=1, description="null: up to context.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    store: bool | None = Field(None, description=IGNORED)
    metadata: dict[str, str] | None = Field(None, description=IGNORED)
    service_tier: str | None = Field(None, description=IGNORED)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call when tool_choice forces a call."
    )
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprobToken] | None = None


class FunctionCallOut(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ResponseModel):
    """A streamed piece of a call: index, id, type and name first, then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


class ChatMessageOut(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(ResponseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish | None = None
    stop_reason: int | str | None = None
    error: ErrorInfo | None = Field(None, description='With finish_reason "error": why.')


class ChatCompletionResponse(CompletionEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    system_fingerprint: str | None = None


class ChoiceDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(ResponseModel):
    index: int
    delta: ChoiceDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish | None = None
    stop_reason: int | str | None = None
    error: ErrorInfo | None = Field(None, description='With finish_reason "error": why.')


class ChatCompletionChunk(CompletionEnvelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionStreamResponse(CompletionEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


# ---- models, tokenizer, misc -------------------------------------------------------------
class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "appliance"
    root: str | None = Field(None, description="The checkpoint's, or the adapter's, directory.")
    parent: str | None = Field(None, description="An adapter's base model; null for the base.")
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(RequestModel):
    """vLLM's body: the name requests will select the adapter by, and its PEFT directory
    (absolute, under one of `lora.allowed_dirs`)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str


class TokenizeRequest(RequestModel):
    """Exactly one of `prompt` and `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class RenderedPrompt(ResponseModel):
    """One prompt as the model would see it: the subset of vLLM's render answer that
    token-aware routers read (vllm-router routes on `token_ids`)."""

    model: str
    token_ids: list[int]


class CompletionRenderResponse(RootModel[list[RenderedPrompt]]):
    """One rendered prompt per prompt of a completion request, in order (as vLLM)."""


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str


class StatusResponse(ResponseModel):
    status: Literal["ok"] = "ok"


class HealthResponse(StatusResponse):
    """Liveness, and what the engine runs on: a fallback from FlashInfer or CUDA graphs makes
    a model several times slower, so its reason is shown here (and in metrics)."""

    attention_backend: str  # flashinfer | torch
    attention_fallback_reason: str | None = None
    decode_graphs: bool
    graphs_fallback_reason: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
