"""OpenAI-format errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Handlers raise `APIError`; this module maps everything else onto it in one place: pydantic
validation errors (param = the field's dotted path), engine errors (400/429/503/500),
Starlette's 404/405, and anything unexpected (500 without internals in the message).
"""

from __future__ import annotations

import logging
import math

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from appliance.adapters import AdapterError
from appliance.responses.errors import ResponsesError
from engine.errors import (
    ContextLengthError,
    DeadlineExceededError,
    EngineDeadError,
    InvalidRequestError,
    LoRANotFoundError,
    LoRAPathError,
    QueueFullError,
    RequestFailedError,
)
from engine.sampling_params import SamplingParamsError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable"
TIMEOUT = "timeout_error"

# pydantic's own loc elements for union members, e.g. ("prompt", "list[int]", 0)
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


class APIError(Exception):
    """An error answered with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def _loc_to_param(loc: tuple) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and (p in _UNION_TAGS or "[" in p or p.startswith("function")):
            break
        parts.append(str(p))
    return ".".join(parts)


_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "json_invalid": "invalid_json",
}


def from_validation_error(e: ValidationError) -> APIError:
    """First error wins; a union's per-member errors collapse into one for the field."""
    errors = e.errors(include_url=False)
    first = errors[0]
    param = _loc_to_param(first["loc"])
    kind = first["type"]
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif kind == "missing":
        message = f"Missing required parameter: '{param}'"
    elif len(first["loc"]) > len(param.split(".")):  # a union member failed: say which field
        message = f"Invalid type or value for '{param}': {first['msg']} (or another accepted form)"
    else:
        message = f"Invalid value for '{param}': {first['msg']}"
    code = _CODES.get(kind, "invalid_type" if kind.endswith("_type") else "invalid_value")
    return bad_request(message, param or None, code)


def from_engine_error(e: Exception) -> APIError:
    """Maps engine exceptions to statuses: never-servable 400, full (or a tenant's limit)
    429 with Retry-After, deadline passed 504, dead 503, failed 500; and the adapter
    registry's refusals with the status they carry."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, AdapterError):
        return APIError(e.status, e.message, INVALID_REQUEST, e.param, e.code)
    if isinstance(e, ResponsesError):
        return APIError(e.status, e.message, INVALID_REQUEST, e.param, e.code)
    if isinstance(e, LoRAPathError):
        return APIError(403, str(e), INVALID_REQUEST, e.param, "path_not_allowed")
    if isinstance(e, LoRANotFoundError):
        return APIError(404, str(e), INVALID_REQUEST, e.param, "model_not_found")
    if isinstance(e, SamplingParamsError):
        return bad_request(str(e), e.param)
    if isinstance(e, ContextLengthError):
        return bad_request(str(e), e.param, "context_length_exceeded")
    if isinstance(e, InvalidRequestError):
        return bad_request(str(e), e.param)
    if isinstance(e, QueueFullError):
        retry = str(max(1, math.ceil(e.retry_after_s)))
        return APIError(429, str(e), RATE_LIMIT, None, e.code, {"Retry-After": retry})
    if isinstance(e, DeadlineExceededError):
        return APIError(504, str(e), TIMEOUT, None, "deadline_exceeded")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), UNAVAILABLE, None, "engine_unavailable")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), SERVER_ERROR, None, "engine_error")
    logger.error("unexpected error", exc_info=e)
    return APIError(500, "internal server error", SERVER_ERROR, None, "internal_error")


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's 404/405 (unknown route, wrong method) in OpenAI format."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message, code = f"Not found: {request.method} {request.url.path}", "not_found"
    elif exc.status_code == 405:
        message, code = (
            f"Method {request.method} not allowed on {request.url.path}",
            "method_not_allowed",
        )
    else:
        message, code = exc.detail or "HTTP error", None
    err = APIError(exc.status_code, message, INVALID_REQUEST, None, code, exc.headers)
    return err.response()


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def client_disconnect_handler(request: Request, exc: Exception) -> Response:
    """The client left while its body was being read: nothing can be answered. A bare 499,
    as for any other disconnect, so logs and metrics count it as the client's doing."""
    assert isinstance(exc, ClientDisconnect)
    return Response(status_code=499)


async def unhandled_error_handler(request: Request, exc: Exception) -> Response:
    """Last resort: log the traceback, answer a 500 that leaks nothing."""
    logger.error("unhandled error", exc_info=exc, extra={"fields": {"path": request.url.path}})
    return APIError(500, "internal server error", SERVER_ERROR, None, "internal_error").response()
