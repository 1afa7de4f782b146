"""`inference.GRPCInferenceService`: KServe v2 / Triton clients (tritonclient) work unchanged.

Generation follows Triton's vLLM backend (see kserve_tensors.py for the tensors): with
`stream` true, ModelStreamInfer sends one response per engine step holding each sample's new
text; otherwise one response with the whole text (prompt first unless
`exclude_input_in_output`). Responses carry the request's `id`, so a client can interleave
many requests on one bidirectional stream. Errors inside the stream arrive as
`error_message` responses and the stream goes on, as Triton does; the unary rpcs use gRPC
statuses (NOT_FOUND for an unknown model).

A request's deadline is the earlier of the call's gRPC deadline and its `timeout`
parameter (an integer of microseconds, as Triton reads it; 0 means none), else
`server.default_request_timeout_s`; when it passes the request ends with DEADLINE_EXCEEDED
(in-band on a stream).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import nullcontext
from typing import Any

import grpc

from appliance import structured
from appliance.adapters import AdapterRegistry, shown_name
from appliance.config.schema import LoRASection, ServerConfig
from appliance.grpc import errors, kserve_embed
from appliance.grpc.auth import cache_salt_of, caller_of
from appliance.grpc.errors import RpcError, invalid
from appliance.grpc.guard import INTERNAL_MESSAGE
from appliance.grpc.kserve_tensors import INPUTS, OUTPUTS, LLMRequest, infer_response, parse_request
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb
from appliance.grpc.proto.inference import grpc_service_pb2_grpc as kpb_grpc
from appliance.telemetry import Tracing, record_request_span
from appliance.tenancy import Tenancy
from engine.lora_request import LoRARequest
from engine.output.request_output import SampleError
from engine.request_stream import RequestStream, sole_choice_error
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
_VERSIONS = ("", "1")


def _field_of(param: str | None, parsed: LLMRequest | None = None) -> str:
    if structured.is_engine_param(param):
        c = parsed.constraint if parsed is not None else None
        return c.field if c is not None else "sampling_parameters"
    if param in _SAMPLING_FIELDS:
        return f"sampling_parameters.{param}"
    if param in ("model", "lora_request"):  # the adapter model_name selected
        return "model_name"
    if param in (None, "prompt"):
        return "text_input"
    return param


def _set_sample_errors(
    resp: kpb.ModelInferResponse, failed: dict[int, SampleError], field_of: Callable
) -> None:
    """Samples of an n > 1 request that ended by their own constraints: finish_reason
    "error" (with `return_finish_reason`) and, always, the response parameter
    `sample_errors`, a JSON object from sample index to the message."""
    if failed:
        text = {str(i): errors.sample_error_text(e, field_of) for i, e in sorted(failed.items())}
        resp.parameters["sample_errors"].string_param = json.dumps(text)


def _wants_final_flag(req: kpb.ModelInferRequest) -> bool:
    p = req.parameters.get("triton_enable_empty_final_response")
    return p is not None and p.bool_param


def _cache_salt(req: kpb.ModelInferRequest, metadata: Any, by_api_key: bool) -> tuple[str, ...]:
    """The request parameter `cache_salt` (a non-empty string), and the caller's API key
    with server.cache_salt_by_api_key: see appliance.tenancy."""
    p = req.parameters.get("cache_salt")
    user = None
    if p is not None:
        if p.WhichOneof("parameter_choice") != "string_param" or not p.string_param:
            raise invalid("parameters.cache_salt", "must be a non-empty string")
        user = p.string_param
    return cache_salt_of(metadata, user, by_api_key)


def _timeout_s(req: kpb.ModelInferRequest, remaining: float | None) -> float | None:
    """Seconds the request may take: its `timeout` parameter (microseconds, 0: none) and
    the call's gRPC deadline (`remaining`), the earlier of the two; None when neither."""
    p = req.parameters.get("timeout")
    given = None
    if p is not None:
        kind = p.WhichOneof("parameter_choice")
        value = getattr(p, kind) if kind in ("int64_param", "uint64_param") else None
        if value is None or value < 0:
            raise invalid(
                "parameters.timeout", "must be an integer number of microseconds >= 0 (0: none)"
            )
        given = value / 1e6 if value else None
    if remaining is not None:
        given = remaining if given is None else min(given, remaining)
    return given


class KServeServicer(kpb_grpc.GRPCInferenceServiceServicer):
    """Serves the engine's one model as a KServe v2 model named `model_name`, version "1"."""

    def __init__(
        self,
        async_engine: Any,
        model_name: str,
        tracing: Tracing | None = None,
        server_version: str = "0.1.0",
        cache_salt_by_api_key: bool = False,
        adapters: AdapterRegistry | None = None,
        tenancy: Tenancy | None = None,
    ):
        self._engine = async_engine
        self._tenancy = tenancy or Tenancy(ServerConfig())
        self._model = model_name
        self._tracing = tracing
        self._version = server_version
        self._salt_by_key = cache_salt_by_api_key
        self._adapters = adapters or AdapterRegistry(async_engine, LoRASection(), model_name)

    def _known(self, name: str, version: str) -> bool:
        """The base model and every loaded LoRA adapter are models here, each version "1"."""
        return version in _VERSIONS and (
            name == self._model or self._adapters.get(name) is not None
        )

    def _check_model(self, name: str, version: str) -> LoRARequest | None:
        """The adapter `name` selects (None: the base model); NOT_FOUND for anything else."""
        lora = self._adapters.get(name) if version in _VERSIONS else None
        if lora is None and not (name == self._model and version in _VERSIONS):
            raise RpcError(
                grpc.StatusCode.NOT_FOUND,
                f"Request for unknown model: '{shown_name(name)}' version "
                f"'{shown_name(version)}' is not found",
            )
        return lora

    # ---- health and metadata ----------------------------------------------------------------
    async def ServerLive(self, request: Any, context: Any) -> kpb.ServerLiveResponse:
        return kpb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> kpb.ServerReadyResponse:
        return kpb.ServerReadyResponse(ready=bool(self._engine.is_healthy))

    async def ModelReady(self, request: Any, context: Any) -> kpb.ModelReadyResponse:
        ready = self._known(request.name, request.version) and bool(self._engine.is_healthy)
        return kpb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: Any, context: Any) -> kpb.ServerMetadataResponse:
        return kpb.ServerMetadataResponse(name="appliance", version=self._version, extensions=[])

    async def ModelMetadata(
        self, request: kpb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> kpb.ModelMetadataResponse:
        try:
            self._check_model(request.name, request.version)
        except RpcError as e:
            await errors.abort(context, e)
        meta = kpb.ModelMetadataResponse(name=request.name, versions=["1"], platform="appliance")
        embed = self._engine.task == "embed"
        for name, datatype, shape in kserve_embed.INPUTS if embed else INPUTS:
            meta.inputs.add(name=name, datatype=datatype, shape=shape)
        for name, datatype, shape in kserve_embed.OUTPUTS if embed else OUTPUTS:
            if embed and name == "embedding":
                shape = [-1, self._engine.embedding_size]
            meta.outputs.add(name=name, datatype=datatype, shape=shape)
        return meta

    # ---- inference --------------------------------------------------------------------------
    async def ModelInfer(
        self, request: kpb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> kpb.ModelInferResponse:
        """The whole generation in one response (`stream` must be false here)."""
        result = None
        parsed: LLMRequest | None = None
        if self._engine.task == "embed":
            return await self._embed(request, context)
        try:
            lora = self._check_model(request.model_name, request.model_version)
            parsed = await self._engine.offload_if_large(request.ByteSize(), parse_request, request)
            if parsed.stream:
                raise errors.invalid("stream", "ModelInfer is unary; stream with ModelStreamInfer")
            remaining = context.time_remaining()
            metadata = context.invocation_metadata()
            async for resp in self._generate(request, parsed, metadata, lora, remaining):
                result = resp
        except RpcError as e:
            await errors.abort(context, e)
        except errors.ENGINE_ERRORS as e:
            err = errors.from_engine_error(e, lambda p: _field_of(p, parsed))
            await errors.abort(context, err)
        return result

    async def _embed(
        self, request: kpb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> kpb.ModelInferResponse:
        """ModelInfer on an embedding model (kserve_embed.py)."""
        try:
            self._check_model(request.model_name, request.model_version)
            caller = caller_of(
                context.invocation_metadata(), self._tenancy,
                _timeout_s(request, context.time_remaining()), time.monotonic(),
            )  # fmt: skip
            return await kserve_embed.infer(self._engine, request, request.model_name, caller)
        except RpcError as e:
            await errors.abort(context, e)
        except errors.ENGINE_ERRORS as e:
            await errors.abort(context, errors.from_engine_error(e, kserve_embed.field_of))
        raise AssertionError("not reached: abort raises")

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[kpb.ModelInferRequest], context: Any
    ) -> AsyncIterator[kpb.ModelStreamInferResponse]:
        """Runs every request read from the stream concurrently; ends once all are done."""
        out: asyncio.Queue[kpb.ModelStreamInferResponse | None] = asyncio.Queue()
        carrier = context.invocation_metadata()
        tasks: set[asyncio.Task] = set()

        async def read() -> None:
            try:
                async for req in request_iterator:
                    remaining = context.time_remaining()
                    task = asyncio.create_task(
                        self._stream_one(req, carrier, out.put_nowait, remaining)
                    )
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:  # the client half-closed: finish what it asked for
                    await asyncio.wait(set(tasks))
            finally:
                out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await out.get()) is not None:
                yield item
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()  # a cancelled call aborts every request it started

    async def _stream_one(
        self,
        req: kpb.ModelInferRequest,
        carrier: Any,
        emit: Callable[[kpb.ModelStreamInferResponse], None],
        remaining: float | None = None,
    ) -> None:
        def fail(message: str) -> None:
            head = kpb.ModelInferResponse(model_name=req.model_name, id=req.id)
            emit(kpb.ModelStreamInferResponse(error_message=message, infer_response=head))

        parsed: LLMRequest | None = None
        embed = self._engine.task == "embed"
        try:
            lora = self._check_model(req.model_name, req.model_version)
            if embed:  # one response per request: the whole batch's embeddings
                caller = caller_of(
                    carrier, self._tenancy, _timeout_s(req, remaining), time.monotonic()
                )
                resp = await kserve_embed.infer(self._engine, req, req.model_name, caller)
                emit(kpb.ModelStreamInferResponse(infer_response=resp))
                return
            parsed = await self._engine.offload_if_large(req.ByteSize(), parse_request, req)
            async for resp in self._generate(req, parsed, carrier, lora, remaining):
                emit(kpb.ModelStreamInferResponse(infer_response=resp))
        except RpcError as e:
            fail(e.message)
        except errors.ENGINE_ERRORS as e:
            field_of = kserve_embed.field_of if embed else (lambda p: _field_of(p, parsed))
            fail(errors.from_engine_error(e, field_of).message)
        except Exception:  # a bug: answer this request in-band, keep the stream's others
            logger.exception("kserve stream request failed", extra={"fields": {"id": req.id}})
            fail(INTERNAL_MESSAGE)

    async def _generate(
        self,
        req: kpb.ModelInferRequest,
        parsed: LLMRequest,
        carrier: Any,
        lora: LoRARequest | None,
        remaining: float | None = None,
    ) -> AsyncIterator[kpb.ModelInferResponse]:
        """`remaining`: seconds left of the call's gRPC deadline (None: it has none)."""
        arrival = time.monotonic()
        # Client ids ("1", "2", ...) collide across clients; the engine gets its own.
        rid = f"kserve-{uuid.uuid4().hex}"
        final_flag = _wants_final_flag(req)
        n = parsed.params.n
        stream: RequestStream | None = None
        error: str | None = None
        caller = caller_of(carrier, self._tenancy, _timeout_s(req, remaining), arrival)
        try:
            salt = caller.salt + _cache_salt(req, carrier, self._salt_by_key)
            with self._adapters.admitting(lora) if lora else nullcontext():
                stream = await self._engine.add_request(
                    parsed.text, parsed.params, rid, cache_salt=salt,
                    lora_request=lora, tenant=caller.tenant, deadline=caller.deadline,
                    input_size=req.ByteSize(),
                )  # fmt: skip
            if lora is not None:
                self._adapters.count_request(lora)
            field_of = functools.partial(_field_of, parsed=parsed)
            if parsed.stream:
                async for delta in stream:
                    if not delta.outputs:
                        continue
                    texts, counts = [""] * n, [0] * n
                    failed: dict[int, SampleError] = {}
                    for d in delta.outputs:
                        texts[d.index], counts[d.index] = d.text, len(d.token_ids)
                        if d.error is not None:
                            failed[d.index] = d.error
                    final = delta.finished if final_flag else None
                    resp = self._response(req, parsed, stream, texts, counts, final)
                    _set_sample_errors(resp, failed, field_of)
                    yield resp
                out = stream.output()
                if (err := sole_choice_error([out])) is not None:
                    raise err  # its only sample failed: an in-band error names why
            else:
                out = await stream.result()
                if (err := sole_choice_error([out])) is not None:
                    raise err  # INVALID_ARGUMENT naming the field
                prefix = "" if parsed.exclude_input else parsed.text
                texts = [prefix + c.text for c in out.outputs]
                counts = [len(c.token_ids) for c in out.outputs]
                resp = self._response(
                    req, parsed, stream, texts, counts, True if final_flag else None
                )
                failed = {c.index: c.error for c in out.outputs if c.error is not None}
                _set_sample_errors(resp, failed, field_of)
                yield resp
        except errors.ENGINE_ERRORS as e:
            error = str(e)
            raise
        finally:
            if stream is not None:
                stream.abort()  # a no-op once it finished
                record_request_span(
                    self._tracing, carrier, stream.output() if self._tracing else None,
                    operation="text_completion",
                    model=req.model_name, params=parsed.params, request_id=rid,
                    error=error, aborted=stream.aborted and not error,
                    tenant=caller.tenant.name,
                )  # fmt: skip

    def _response(
        self,
        req: kpb.ModelInferRequest,
        parsed: LLMRequest,
        stream: RequestStream,
        texts: list[str],
        token_counts: list[int],
        final: bool | None,
    ) -> kpb.ModelInferResponse:
        flags = parsed.flags
        reasons = [r or "" for r in stream.finish_reasons()]
        return infer_response(
            req,
            req.model_name,  # the base model's or the adapter's, as asked
            texts,
            finish_reasons=reasons if flags.get("return_finish_reason") else None,
            num_input_tokens=stream.num_prompt_tokens
            if flags.get("return_num_input_tokens")
            else None,
            num_output_tokens=token_counts if flags.get("return_num_output_tokens") else None,
            final=final,
        )
