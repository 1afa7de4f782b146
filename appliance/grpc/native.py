"""The native `appliance.v1.Appliance` service: typed, streaming generation over gRPC.

`Generate` sends one response per sample delta, as the engine's `RequestStream` hands them
out (coalesced when the client reads slower than the engine writes, never dropped); the
`Abort` rpc aborts that stream from another call, and it then ends with one "abort" delta
for each sample that had not finished.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import grpc

from appliance import structured
from appliance.adapters import AdapterRegistry, shown_name
from appliance.config.schema import LoRASection, ServerConfig
from appliance.dialect.chat_output import ChatDialect, DialectError, constrain, for_prompt
from appliance.grpc import errors, native_embed
from appliance.grpc.auth import cache_salt_of, caller_of
from appliance.grpc.errors import RpcError, invalid
from appliance.grpc.native_chat import (
    ChatParsers,
    ChatReader,
    as_invalid,
    dialect_of,
    template_call,
)
from appliance.grpc.native_responses import ResponsesRpcs
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.responses.store import ResponseStore, memory_store
from appliance.responses.turn import Parsers
from appliance.telemetry import Tracing, record_request_span
from appliance.tenancy import Tenancy
from engine.lora_request import LoRARequest
from engine.output.request_output import SampleDelta
from engine.request_stream import RequestStream, TokenCounts, sole_choice_error
from engine.sampling_params import SamplingParams

# Proto fields copied as they are when set (the `optional` scalars).
_OPTIONAL_SCALARS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "logprobs", "skip_special_tokens",
    "spaces_between_special_tokens",
)  # fmt: skip
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


def sampling_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    """Engine SamplingParams from the proto; raises SamplingParamsError naming the field."""
    kw: dict[str, Any] = {
        name: getattr(sp, name) for name in _OPTIONAL_SCALARS if sp.HasField(name)
    }
    if sp.HasField("max_tokens"):
        kw["max_tokens"] = sp.max_tokens or None
    kw["stop"] = list(sp.stop)
    kw["stop_token_ids"] = sp.stop_token_ids  # SamplingParams makes the one set
    kw["include_stop_str_in_output"] = sp.include_stop_str_in_output
    kw["ignore_eos"] = sp.ignore_eos
    kw["min_tokens"] = sp.min_tokens
    if sp.logit_bias:
        kw["logit_bias"] = dict(sp.logit_bias)
    if sp.allowed_token_ids:
        kw["allowed_token_ids"] = list(sp.allowed_token_ids)
    if (c := constraint(sp)) is not None:
        kw["structured_outputs"] = c.params
    return SamplingParams(**kw)


def constraint(sp: pb.SamplingParams) -> structured.Constraint | None:
    """The `structured_outputs` oneof; errors name `sampling.<field>`."""
    kind = sp.WhichOneof("structured_outputs")
    if kind is None:
        return None
    value = list(sp.choice.choices) if kind == "choice" else getattr(sp, kind)
    engine_kind = "json" if kind == "json_schema" else kind
    return structured.build([structured.Given(f"sampling.{kind}", engine_kind, value)])


@dataclass
class _Prepared:
    """A Generate call read: its prompt, where it came from, its parameters and dialect."""

    prompt: str | list[int]
    operation: str  # GenAI operation name: text_completion | chat
    prompt_field: str  # the request field that held the prompt
    params: SamplingParams
    dialect: ChatDialect | None


@dataclass
class _Call:
    """One Generate call in flight: its stream once the engine holds the request, and
    whether `Abort` came first (then the stream is aborted as soon as it exists)."""

    stream: RequestStream | None = None
    abort_asked: bool = False

    def abort(self) -> None:
        self.abort_asked = True
        if self.stream is not None:
            self.stream.abort()


class ApplianceServicer(pb_grpc.ApplianceServicer):
    """Serves one model from an AsyncEngine. See appliance.proto for the contract."""

    def __init__(
        self,
        async_engine: Any,
        model_name: str,
        tracing: Tracing | None = None,
        cache_salt_by_api_key: bool = False,
        chat_parsers: ChatParsers | None = None,
        adapters: AdapterRegistry | None = None,
        responses_store: ResponseStore | None = None,
        keyed: bool = False,
        tenancy: Tenancy | None = None,
    ):
        self._engine = async_engine
        self._tenancy = tenancy or Tenancy(ServerConfig())
        self._model = model_name
        self._adapters = adapters or AdapterRegistry(async_engine, LoRASection(), model_name)
        self._tracing = tracing
        self._salt_by_key = cache_salt_by_api_key
        self._parsers = chat_parsers or ChatParsers()
        # In-flight Generate calls of this server, for Abort.
        self._active: dict[str, _Call] = {}
        # Respond, GetResponse, DeleteResponse (`keyed`: the server has API keys, so stored
        # responses belong to the caller's key).
        self._responses = ResponsesRpcs(
            async_engine, model_name, responses_store or memory_store(),
            Parsers(self._parsers.tool_parser, self._parsers.reasoning_parser),
            self._adapters, keyed, cache_salt_by_api_key, self._tenancy,
        )  # fmt: skip

    # ---- helpers ----------------------------------------------------------------------------
    @property
    def _tokenizer(self) -> Any:
        return self._engine.tokenizer

    def _resolve(self, model: str, adapter: str = "") -> LoRARequest | None:
        """The adapter a call selects (`adapter`, else a `model` naming one), None for the
        base model; NOT_FOUND for a name that is neither."""
        if adapter:
            if model not in ("", self._model, adapter):
                raise invalid(
                    "adapter", f"{shown_name(adapter)!r} conflicts with model {shown_name(model)!r}"
                )
            lora = self._adapters.get(adapter)
            if lora is None:
                raise RpcError(
                    grpc.StatusCode.NOT_FOUND,
                    f"adapter: no LoRA adapter {shown_name(adapter)!r} is loaded",
                )
            return lora
        if not model or model == self._model:
            return None
        lora = self._adapters.get(model)
        if lora is None:
            raise RpcError(
                grpc.StatusCode.NOT_FOUND,
                f"model: {shown_name(model)!r} is not served here ({self._model!r})",
            )
        return lora

    def _render_chat(self, chat: pb.Chat, dialect: ChatDialect | None = None) -> list[int]:
        """The template's token ids; `dialect` (its tools) read from `chat` when not given.
        Work in proportion to the chat: callers run it with `_offload`."""
        dialect = dialect or dialect_of(chat, self._parsers, self._tokenizer)
        messages, kw = template_call(chat, dialect, self._tokenizer)
        try:
            return self._tokenizer.apply_chat_template(messages, **kw)
        except ValueError as e:
            raise invalid("chat.messages", str(e).removeprefix("messages: ")) from e

    async def _offload(self, request: Any, fn: Any, *args: Any) -> Any:
        """`fn(*args)` where work of `request`'s size belongs: on a worker thread when the
        message is large (its serialized bytes are the call's whole input)."""
        return await self._engine.offload_if_large(request.ByteSize(), fn, *args)

    def _prepare(self, request: pb.GenerateRequest) -> _Prepared:
        """The call's prompt (a chat rendered through its dialect) and sampling parameters,
        the dialect's constraint on them: everything that grows with the request."""
        dialect = None
        if request.WhichOneof("prompt") == "chat":
            dialect = dialect_of(request.chat, self._parsers, self._tokenizer)
        kind = request.WhichOneof("prompt")
        if kind == "text":
            prompt, operation, field = request.text, "text_completion", "text"
        elif kind == "token_ids":
            prompt, operation, field = (
                list(request.token_ids.ids),
                "text_completion",
                "token_ids.ids",
            )
        elif kind == "chat":
            prompt, operation, field = (
                self._render_chat(request.chat, dialect),
                "chat",
                "chat.messages",
            )
        else:
            raise invalid("prompt", "one of text, token_ids or chat is required")
        params = sampling_from_proto(request.sampling)
        if dialect is not None:
            dialect = for_prompt(dialect, self._tokenizer, prompt)  # type: ignore[arg-type]
            try:
                constrain(params, dialect)
            except DialectError as e:
                raise as_invalid(e) from None
        return _Prepared(prompt, operation, field, params, dialect)

    def _cache_salt(self, request: pb.GenerateRequest, context: Any) -> tuple[str, ...]:
        user = request.cache_salt if request.HasField("cache_salt") else None
        if user == "":
            raise invalid("cache_salt", "must not be empty when set")
        return cache_salt_of(context.invocation_metadata(), user, self._salt_by_key)

    # ---- rpcs -------------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.monotonic()
        params: SamplingParams | None = None
        tenant: str | None = None
        operation, prompt_field = "text_completion", "prompt"
        rid: str | None = None
        call: _Call | None = None
        error: str | None = None
        dialect: ChatDialect | None = None
        served = request.adapter or request.model or self._model  # for the span

        def field_of(param: str | None) -> str:
            if structured.is_engine_param(param):
                kind = request.sampling.WhichOneof("structured_outputs")
                if kind is None and dialect is not None and dialect.forced:
                    return "chat.tools"  # the grammar of a forced call
                return f"sampling.{kind}" if kind else "sampling"
            if param in _SAMPLING_FIELDS:
                return f"sampling.{param}"
            if param in ("model", "lora_request"):  # the adapter the call selected
                return "adapter" if request.adapter else "model"
            if param in (None, "prompt", "messages"):
                return prompt_field
            return param

        try:
            lora = self._resolve(request.model, request.adapter)
            if request.WhichOneof("prompt") == "chat":
                prompt_field = "chat.messages"
            prep = await self._offload(request, self._prepare, request)
            prompt, operation, params, dialect = (
                prep.prompt,
                prep.operation,
                prep.params,
                prep.dialect,
            )
            prompt_field = prep.prompt_field
            reader = ChatReader(dialect) if dialect is not None else None
            metadata = context.invocation_metadata()
            caller = caller_of(metadata, self._tenancy, context.time_remaining(), arrival)
            tenant = caller.tenant.name
            salt = caller.salt + self._cache_salt(request, context)
            rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
            if rid in self._active:
                raise invalid("request_id", f"{rid!r} is already in flight")
            call = self._active[rid] = _Call()
            with self._adapters.admitting(lora) if lora else nullcontext():
                stream = await self._engine.add_request(
                    prompt, params, rid, priority=request.priority, cache_salt=salt,
                    lora_request=lora, tenant=caller.tenant, deadline=caller.deadline,
                    input_size=request.ByteSize(),
                )  # fmt: skip
            if lora is not None:
                self._adapters.count_request(lora)
            call.stream = stream
            if call.abort_asked:
                stream.abort()
            async for delta in stream:
                for i, d in enumerate(delta.outputs):
                    last = delta.finished and i == len(delta.outputs) - 1
                    resp = self._response(rid, d, stream.counts() if last else None)
                    if d.error is not None:
                        resp.error = errors.sample_error_text(d.error, field_of)
                    if reader is not None:
                        reader.fill(resp, d.text, d.finish_reason)
                    yield resp
            failed = sole_choice_error([stream.output()])
            if failed is not None:  # its only sample failed: the call's status says why
                raise failed
        except RpcError as e:
            error = e.message
            await errors.abort(context, e)
        except errors.ENGINE_ERRORS as e:
            err = errors.from_engine_error(e, field_of)
            error = err.message
            await errors.abort(context, err)
        finally:
            if call is not None and rid is not None:
                self._active.pop(rid, None)
                stream = call.stream
                if stream is not None:
                    stream.abort()  # a no-op once it finished
                    record_request_span(
                        self._tracing, context.invocation_metadata(),
                        stream.output() if self._tracing else None,
                        operation=operation, model=served, params=params,
                        request_id=rid, error=error, aborted=stream.aborted and not error,
                        tenant=tenant,
                    )  # fmt: skip

    def _response(self, rid: str, d: SampleDelta, usage: TokenCounts | None) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(
            request_id=rid,
            index=d.index,
            text=d.text,
            token_ids=d.token_ids,
            finish_reason=d.finish_reason or "",
        )
        for lp in d.logprobs or ():
            resp.logprobs.add(
                token_id=lp.token_id,
                logprob=lp.logprob,
                rank=lp.rank,
                top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
            )
        if isinstance(d.stop_reason, str):
            resp.stop_string = d.stop_reason
        elif isinstance(d.stop_reason, int):
            resp.stop_token_id = d.stop_reason
        if usage is not None:
            resp.usage.CopyFrom(
                pb.Usage(
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    cached_tokens=usage.cached_tokens,
                )
            )
        return resp

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            self._resolve(request.model)  # any served name; one tokenizer
            ids = await self._offload(request, self._tokenize, request)
        except RpcError as e:
            await errors.abort(context, e)
        return pb.TokenizeResponse(
            token_ids=ids, count=len(ids), max_model_len=self._engine.max_model_len
        )

    def _tokenize(self, request: pb.TokenizeRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "chat":
            return self._render_chat(request.chat)
        if kind == "text":
            add_special = (
                request.add_special_tokens if request.HasField("add_special_tokens") else True
            )
            return self._tokenizer.encode(request.text, add_special_tokens=add_special)
        raise invalid("input", "one of text or chat is required")

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        try:
            self._resolve(request.model)  # any served name; one tokenizer
            text = await self._offload(request, self._detokenize, list(request.token_ids))
        except RpcError as e:
            await errors.abort(context, e)
        return pb.DetokenizeResponse(text=text)

    def _detokenize(self, ids: list[int]) -> str:
        vocab = self._tokenizer.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise invalid("token_ids", f"token id {bad} is outside the vocabulary ({vocab})")
        return self._tokenizer.decode(ids)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        max_len = self._engine.max_model_len
        models = [
            pb.Model(
                id=self._model, max_model_len=max_len, owned_by="appliance",
                root=self._engine.config.model.path or "",
            )
        ]  # fmt: skip
        for lora in self._adapters.adapters():
            models.append(
                pb.Model(
                    id=lora.lora_name, max_model_len=max_len, owned_by="appliance",
                    parent=self._model, root=lora.lora_path,
                )
            )  # fmt: skip
        return pb.ListModelsResponse(models=models)

    async def Respond(
        self, request: pb.RespondRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RespondEvent]:
        async for event in self._responses.respond(request, context, self._resolve):
            yield event

    async def GetResponse(
        self, request: pb.ResponseRef, context: grpc.aio.ServicerContext
    ) -> pb.StoredResponse:
        return await self._responses.get(request, context)

    async def DeleteResponse(
        self, request: pb.ResponseRef, context: grpc.aio.ServicerContext
    ) -> pb.DeleteResponseReply:
        return await self._responses.delete(request, context)

    async def Embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        """See native_embed.py."""
        try:
            arrival = time.monotonic()
            metadata = context.invocation_metadata()
            caller = caller_of(metadata, self._tenancy, context.time_remaining(), arrival)
            return await native_embed.embed(
                self._engine, self._model, request, context, self._tracing, caller
            )
        except RpcError as e:
            await errors.abort(context, e)
            raise  # not reached: abort raises

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        call = self._active.get(request.request_id)
        if call is None:
            await errors.abort(
                context,
                RpcError(
                    grpc.StatusCode.NOT_FOUND,
                    f"request_id: no Generate call {request.request_id!r} in flight",
                    None,
                ),
            )
        call.abort()
        return pb.AbortResponse()
