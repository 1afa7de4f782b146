"""Engine errors -> gRPC statuses, the same mapping for every service.

An INVALID_ARGUMENT names the offending field twice: the message starts with its path in
the request (`sampling.temperature: must be >= 0`), and a `google.rpc.BadRequest` detail in
the standard `grpc-status-details-bin` trailer carries it for clients that read rich errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from appliance.adapters import AdapterError
from engine.errors import (
    DeadlineExceededError,
    EngineDeadError,
    InvalidRequestError,
    LoRANotFoundError,
    LoRAPathError,
    QueueFullError,
    RequestFailedError,
    UnsatisfiableRequestError,
)
from engine.output.request_output import SampleError
from engine.sampling_params import SamplingParamsError

# Errors a request can raise before or while it streams, and the status each becomes.
ENGINE_ERRORS = (
    AdapterError,
    InvalidRequestError,
    SamplingParamsError,
    QueueFullError,
    EngineDeadError,
    RequestFailedError,
    DeadlineExceededError,
)


@dataclass
class RpcError(Exception):
    """A status to end the call with; raised by request parsing, turned into `context.abort`."""

    code: grpc.StatusCode
    message: str
    field: str | None = None

    def __str__(self) -> str:
        return self.message


_ADAPTER_CODES = {404: grpc.StatusCode.NOT_FOUND, 403: grpc.StatusCode.PERMISSION_DENIED}


def invalid(field: str, reason: str) -> RpcError:
    """INVALID_ARGUMENT whose message starts with the field path."""
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {reason}", field)


def from_engine_error(exc: BaseException, field_of: Callable[[str | None], str]) -> RpcError:
    """Maps an engine error; `field_of` turns the engine's param name into a request path."""
    if isinstance(exc, AdapterError):  # the adapter registry's refusal, an HTTP status
        field = field_of(exc.param)
        code = _ADAPTER_CODES.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT)
        keep = field if code is grpc.StatusCode.INVALID_ARGUMENT else None
        return RpcError(code, f"{field}: {exc.message}", keep)
    if isinstance(exc, LoRAPathError):
        return RpcError(grpc.StatusCode.PERMISSION_DENIED, f"{field_of(exc.param)}: {exc}")
    if isinstance(exc, LoRANotFoundError):
        return RpcError(grpc.StatusCode.NOT_FOUND, f"{field_of(exc.param)}: {exc}")
    if isinstance(exc, SamplingParamsError):
        return invalid(field_of(exc.param), exc.reason)
    if isinstance(exc, InvalidRequestError):
        field = field_of(exc.param)
        message = str(exc)
        if exc.param and field != exc.param and message.startswith(f"{exc.param}:"):
            message = field + message[len(exc.param) :]  # the engine's name -> the field's
        if not message.startswith(f"{field}:"):
            message = f"{field}: {message}"
        return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message, field)
    if isinstance(exc, QueueFullError):
        return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, DeadlineExceededError):
        return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
    if isinstance(exc, EngineDeadError):
        return RpcError(grpc.StatusCode.UNAVAILABLE, str(exc))
    if isinstance(exc, RequestFailedError):
        return RpcError(grpc.StatusCode.INTERNAL, f"the engine failed the request: {exc}")
    return RpcError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def sample_error_text(err: SampleError, field_of: Callable[[str | None], str]) -> str:
    """A failed sample's `error` text: the message its INVALID_ARGUMENT would carry."""
    return from_engine_error(UnsatisfiableRequestError(err.message, err.param), field_of).message


def _trailer(err: RpcError) -> tuple[tuple[str, bytes], ...]:
    if err.field is None:
        return ()
    detail = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=err.field, description=err.message)
        ]
    )
    packed = any_pb2.Any()
    packed.Pack(detail)
    status = status_pb2.Status(
        code=code_pb2.INVALID_ARGUMENT, message=err.message, details=[packed]
    )
    return (("grpc-status-details-bin", status.SerializeToString()),)


async def abort(context: grpc.aio.ServicerContext, err: RpcError) -> None:
    """Ends the call with `err`'s status (raises, as `context.abort` does)."""
    await context.abort(err.code, err.message, _trailer(err))


def field_violation(rpc_error: grpc.aio.AioRpcError) -> str | None:
    """Client side: the field a BadRequest detail names, if the status carries one."""
    for key, value in rpc_error.trailing_metadata() or ():
        if key != "grpc-status-details-bin":
            continue
        status = status_pb2.Status.FromString(value)
        for packed in status.details:
            detail = error_details_pb2.BadRequest()
            if packed.Unpack(detail) and detail.field_violations:
                return detail.field_violations[0].field
    return None
