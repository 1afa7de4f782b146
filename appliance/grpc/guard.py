"""Last line of defence for every gRPC method: undecodable requests and unexpected errors.

Without it grpc.aio answers both with UNKNOWN and the exception's text
(`Unexpected <class 'DecodeError'>: ...`, or a traceback's last line from deep inside the
server). Clients should instead see INVALID_ARGUMENT for bytes that are not the method's
request message, as for any other bad input, and INTERNAL with a message that leaks
nothing for a server bug, which is logged with its traceback, as the HTTP frontend does.

A unary request is decoded before the handler runs, so a bad one is handed over as an
`_Undecodable` sentinel and refused by the wrapper; in a request stream the handler pulls
messages itself, so a bad one raises `UndecodableMessage` out of its read, which the
wrapper turns into the same INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal error; the server logged the details"


class _Undecodable:
    """Stands in for a request message whose bytes did not parse."""

    def __init__(self, error: Exception):
        self.error = error


class UndecodableMessage(Exception):
    """A message of a request stream did not parse."""


def _tolerant(
    deserializer: Callable[[bytes], Any] | None, unary_request: bool
) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as e:  # DecodeError, invalid UTF-8 in a string field, ...
            if unary_request:
                return _Undecodable(e)
            raise UndecodableMessage(str(e)) from e

    return decode


async def _reject(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await _invalid(context, request.error)


async def _invalid(context: grpc.aio.ServicerContext, error: Exception) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message for this method ({error})"
    )


async def _internal(method: str, context: grpc.aio.ServicerContext) -> None:
    logger.exception("grpc handler failed", extra={"fields": {"method": method}})
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


@contextlib.asynccontextmanager
async def _mapped_errors(method: str, context: grpc.aio.ServicerContext):
    """Undecodable requests become INVALID_ARGUMENT and unexpected exceptions INTERNAL;
    aborts and cancellation pass through untouched."""
    try:
        yield
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise
    except UndecodableMessage as e:
        await _invalid(context, e)
    except Exception:
        await _internal(method, context)


def _guard(behavior: Any, method: str, unary_request: bool) -> Any:
    """`behavior` with undecodable requests refused and unexpected exceptions made INTERNAL."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if unary_request:
                await _reject(request, context)
            async with _mapped_errors(method, context):
                async for item in behavior(request, context):
                    yield item

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if unary_request:
                await _reject(request, context)
            async with _mapped_errors(method, context):
                return await behavior(request, context)

        return unary
    return behavior  # synchronous handlers are not ours; leave them as they are


def same_shape(
    handler: grpc.RpcMethodHandler,
    behavior: Callable[[Any, bool], Any],
    request_deserializer: Callable[[bytes], Any] | None,
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind (unary/streaming each way) running
    `behavior(original behavior, unary_request)`, with `request_deserializer`."""
    kw = {"request_deserializer": request_deserializer,
          "response_serializer": handler.response_serializer}  # fmt: skip
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior(handler.stream_stream, False), **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior(handler.stream_unary, False), **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior(handler.unary_stream, True), **kw)
    return grpc.unary_unary_rpc_method_handler(behavior(handler.unary_unary, True), **kw)


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler (see the module docstring); install it innermost."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        deserializer = _tolerant(handler.request_deserializer, not handler.request_streaming)
        return same_shape(handler, lambda b, unary: _guard(b, details.method, unary), deserializer)
