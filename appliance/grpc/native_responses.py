"""The Responses API on the native gRPC service: `Respond` (the request body as JSON, the
stream's events one message each), `GetResponse` and `DeleteResponse`.

Everything but the transport is appliance/responses', shared with HTTP: the field policy,
the previous response, the turn, the builder, the store and its owner (the API key from
the call's `authorization` metadata, hashed, when the server has keys). Errors are gRPC
statuses: INVALID_ARGUMENT naming the field (as HTTP's 400), NOT_FOUND (HTTP's 404), and
the engine's statuses as for Generate. A generation that fails mid-stream ends with its
`response.failed` event, as over HTTP; cancelling the call aborts the request.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import nullcontext
from typing import Any

import grpc

from appliance.adapters import AdapterRegistry
from appliance.config.schema import ServerConfig
from appliance.grpc import errors
from appliance.grpc.auth import bearer_token, cache_salt_of, caller_of
from appliance.grpc.errors import RpcError
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.http.convert import chat_logprobs
from appliance.responses import service
from appliance.responses.errors import ResponsesError
from appliance.responses.items import new_id
from appliance.responses.protocol import OutputTextLogprob
from appliance.responses.run import ResponseRun
from appliance.responses.store import ResponseStore
from appliance.responses.turn import Parsers, Turn
from appliance.tenancy import Tenancy, response_owner


def as_rpc_error(e: ResponsesError) -> RpcError:
    if e.status == 404:
        return RpcError(grpc.StatusCode.NOT_FOUND, e.message)
    field = e.param or "body_json"
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {e.message}", field)


class ResponsesRpcs:
    """The three rpcs over one engine, store and adapter registry (ApplianceServicer's)."""

    def __init__(
        self,
        engine: Any,
        model: str,
        store: ResponseStore,
        parsers: Parsers,
        adapters: AdapterRegistry,
        keyed: bool,
        salt_by_key: bool,
        tenancy: Tenancy | None = None,
    ):
        self._engine = engine
        self._model = model
        self._store = store
        self._parsers = parsers
        self._adapters = adapters
        self._keyed = keyed
        self._salt_by_key = salt_by_key
        self._tenancy = tenancy or Tenancy(ServerConfig())

    def _owner(self, context: grpc.aio.ServicerContext) -> str:
        key = bearer_token(context.invocation_metadata()) if self._keyed else None
        return response_owner(key)

    async def respond(
        self, request: pb.RespondRequest, context: grpc.aio.ServicerContext, resolve: Any
    ) -> AsyncIterator[pb.RespondEvent]:
        """`resolve(model)`: the LoRA adapter a `model` selects (NOT_FOUND for neither)."""
        arrival = time.monotonic()
        stream = None
        turn: Turn | None = None
        try:
            try:
                data = json.loads(request.body_json)
            except (ValueError, RecursionError) as e:
                raise errors.invalid("body_json", f"not JSON: {e}") from None
            req = service.parse_request(data)
            lora = resolve(req.model or "")
            owner = self._owner(context)
            turn, ids = await service.prepare(
                req, self._store, owner, self._parsers, self._engine.tokenizer,
                self._engine.offload_if_large,
            )  # fmt: skip
            rid = new_id("resp")
            metadata = context.invocation_metadata()
            caller = caller_of(metadata, self._tenancy, context.time_remaining(), arrival)
            salt = caller.salt + cache_salt_of(metadata, req.cache_salt, self._salt_by_key)
            with self._adapters.admitting(lora) if lora else nullcontext():
                stream = await self._engine.add_request(
                    ids, turn.params, rid, priority=req.priority, arrival_time=arrival,
                    cache_salt=salt, lora_request=lora, tenant=caller.tenant,
                    deadline=caller.deadline,
                )  # fmt: skip
            if lora is not None:
                self._adapters.count_request(lora)
            tok = self._engine.tokenizer
            run = ResponseRun(
                turn, rid, req.model or self._model, self._store, owner,
                lambda x: tok.decode(x, skip_special_tokens=False), _logprobs(turn, tok),
            )  # fmt: skip
            async for ev in run.events(stream):
                yield pb.RespondEvent(
                    type=ev["type"], sequence_number=ev["sequence_number"],
                    event_json=json.dumps(ev),
                )  # fmt: skip
        except ResponsesError as e:
            await errors.abort(context, as_rpc_error(e))
        except RpcError as e:
            await errors.abort(context, e)
        except errors.ENGINE_ERRORS as e:
            field_of = turn.client_param if turn is not None else (lambda p: p)
            await errors.abort(
                context, errors.from_engine_error(e, lambda p: field_of(p) or "body_json")
            )
        finally:
            if stream is not None:
                stream.abort()  # a no-op once it finished

    async def get(
        self, request: pb.ResponseRef, context: grpc.aio.ServicerContext
    ) -> pb.StoredResponse:
        try:
            rec = await service.stored(self._store, request.response_id, self._owner(context))
        except ResponsesError as e:
            await errors.abort(context, as_rpc_error(e))
        return pb.StoredResponse(response_json=json.dumps(rec.response))

    async def delete(
        self, request: pb.ResponseRef, context: grpc.aio.ServicerContext
    ) -> pb.DeleteResponseReply:
        if not await self._store.delete(request.response_id, self._owner(context)):
            await errors.abort(context, as_rpc_error(service.missing(request.response_id)))
        return pb.DeleteResponseReply(response_id=request.response_id, deleted=True)


def _logprobs(turn: Turn, tok: Any) -> Any:
    def token_str(token_id: int) -> str:
        return tok.decode([token_id], skip_special_tokens=False)

    def fmt(lps: Any) -> list[OutputTextLogprob]:
        content = chat_logprobs(lps, turn.logprobs or 0, token_str).content or []
        return [OutputTextLogprob(**t.model_dump()) for t in content]

    return fmt
