"""Reading request bodies: content type, size limit while streaming, JSON, validation.

The size limit is enforced on the bytes actually received, not only on Content-Length (a
chunked or lying client cannot push more than `server.max_request_body`), and the whole
body must arrive within `server.body_timeout_s` (else 408 and the connection is closed: a
client that announces a body and sends half of it cannot hold a connection forever). Unsupported
OpenAI parameters are refused here with a 400 naming them, unless the value is the harmless
default (`functions: []`, `audio: null`, ...), which
is dropped before validation.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from appliance.http.errors import APIError, bad_request, from_validation_error

M = TypeVar("M", bound=BaseModel)

# A `\uD800`..`\uDFFF` escape: JSON may spell a lone surrogate, which no text can contain.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

# field -> predicate: True when the value is harmless and may be dropped.
_HARMLESS = {
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "suffix": lambda v: v in (None, ""),
    "use_beam_search": lambda v: v in (None, False),
    # SGLang-dialect fields that sglang-router and vllm-router write into every forwarded
    # body with these defaults (docs/scaling.md); each default is what this server does.
    "no_stop_trim": lambda v: v in (None, False),
    "return_hidden_states": lambda v: v in (None, False),
    "separate_reasoning": lambda v: v in (None, True),
    "stream_reasoning": lambda v: v in (None, True),
    "include_reasoning": lambda v: v in (None, True),
}


def _content_type_ok(value: str | None) -> bool:
    if not value:
        return True  # bare clients (e.g. some `curl --data-binary`) send none; parse as JSON
    mime = value.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (
        mime.startswith("application/") and mime.endswith("+json")
    )


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The raw body, or 413 as soon as more than `limit` bytes are announced or received,
    or 408 when it has not all arrived within `timeout_s` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise _too_large(limit)
        except ValueError:
            raise bad_request("Invalid Content-Length header", None, "invalid_header") from None
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408,
            f"Request body not received within {timeout_s:g} seconds",
            param=None,
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"Request body exceeds the limit of {limit} bytes",
        param=None,
        code="request_too_large",
    )


def _check_text(value: Any, path: str) -> None:
    """400 naming the first string holding a lone surrogate (`"\\ud800"` decodes to one).

    Such a string is valid JSON but not text: the tokenizer, the logs and the response
    encoder would all raise on it, far from where it came in."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(
                f"'{path}' contains an unpaired UTF-16 surrogate escape", path or None
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, path)
            _check_text(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{path}.{i}")


def check_unsupported(data: dict[str, Any]) -> None:
    """400 for unsupported parameters with a meaningful value; drops harmless ones."""
    for name, harmless in _HARMLESS.items():
        if name not in data:
            continue
        if not harmless(data[name]):
            raise bad_request(
                f"'{name}' is not supported by this server", name, "unsupported_parameter"
            )
        del data[name]


# Runs `fn(*args)` inline or on a worker thread by the size of the input it works on
# (`AsyncEngine.offload_if_large`).
Offload = Callable[..., Awaitable[Any]]


def check_content_type(request: Request) -> None:
    """415 unless the body is JSON (a missing Content-Type is read as JSON)."""
    if not _content_type_ok(request.headers.get("content-type")):
        raise APIError(
            415,
            "Content-Type must be application/json",
            param=None,
            code="unsupported_media_type",
        )


async def read_json(
    request: Request,
    model: type[M],
    limit: int,
    timeout_s: float | None = None,
    offload: Offload | None = None,
    prepare: Callable[[dict[str, Any]], None] | None = None,
) -> M:
    """Content type (415), size (413), time (408), JSON syntax (400), fields and types (400).
    With `offload`, parsing and validation run where it puts work of the body's size.
    `prepare` sees the parsed object before validation (a route's own field policy: it may
    drop fields or raise an APIError)."""
    check_content_type(request)
    raw = await read_body(request, limit, timeout_s)
    if offload is not None:
        return await offload(len(raw), parse_json, raw, model, prepare)
    return parse_json(raw, model, prepare)


def parse_json(
    raw: bytes, model: type[M], prepare: Callable[[dict[str, Any]], None] | None = None
) -> M:
    """The body as `model`: JSON syntax, unsupported fields, `prepare`, fields and types
    (400s). Takes time in proportion to the body: callers run it off the event loop when it
    is large."""
    try:
        data = json.loads(raw)
    except RecursionError:  # `[[[[...`: the decoder's recursion limit, not a server fault
        raise bad_request("Request body nests too deeply", None, "invalid_json") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of over 4300 digits
        raise bad_request(f"Request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("Request body must be a JSON object", None, "invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        _check_text(data, "")
    check_unsupported(data)
    if prepare is not None:
        prepare(data)
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        raise from_validation_error(e) from None
