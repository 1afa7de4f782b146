"""The embedding call shared by every frontend (HTTP /v1/embeddings, gRPC Embed, KServe).

One place reads the OpenAI `input` shapes (a string, a list of strings, token ids, or lists
of token ids), bounds a batch, submits every input as its own engine request (so the engine
batches them in its prefill steps) and waits for all of them, aborting every one if any
fails or the caller goes away; and one place encodes a vector as base64 (little-endian
float32, what the openai SDK decodes). Errors are the engine's (`InvalidRequestError` with
`param`), so each frontend maps them to its own protocol as it does for generation.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Callable, Sequence
from typing import Any

from appliance.tenancy import Caller
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.output.request_output import RequestOutput
from engine.pooling_params import PoolingParams
from engine.request_stream import RequestStream

# OpenAI's limit on inputs per request.
MAX_INPUTS = 2048


def inputs_of(value: Any, param: str = "input") -> list[str | list[int]]:
    """The inputs of an OpenAI embeddings `input`: one text or token list, or a batch."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"{param}: must not be empty", param)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [list(value)]
    for i, item in enumerate(value):
        ok = isinstance(item, str) or (
            isinstance(item, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        )
        if not ok:
            raise InvalidRequestError(
                f"{param}[{i}]: must be a string or a list of token ids", f"{param}[{i}]"
            )
    return list(value)


def check_inputs(inputs: Sequence[str | list[int]], max_queue_len: int, param: str = "input"):
    """Raises unless the batch is non-empty, within MAX_INPUTS and the waiting queue's size
    (a larger batch could never be queued whole), and no input is empty."""
    limit = min(MAX_INPUTS, max_queue_len)
    if not inputs:
        raise InvalidRequestError(f"{param}: must not be empty", param)
    if len(inputs) > limit:
        raise InvalidRequestError(
            f"{param}: at most {limit} inputs per request, got {len(inputs)}", param
        )
    for i, item in enumerate(inputs):
        if len(item) == 0:
            where = param if len(inputs) == 1 else f"{param}[{i}]"
            raise InvalidRequestError(f"{where}: must not be empty", where)


async def embed_all(
    aeng: AsyncEngine,
    inputs: Sequence[str | list[int]],
    params: PoolingParams,
    base_id: str,
    *,
    priority: int = 0,
    arrival_time: float | None = None,
    trace: tuple[Callable[[str], None], Callable[[str], None]] | None = None,
    caller: Caller | None = None,
) -> list[RequestOutput]:
    """Every input's output (its `embedding` set), in order. Engine request ids are
    `base_id` (one input) or `base_id-i`. `trace`: (register, forget) of a request tracer:
    each id is registered before it is queued (a short input may finish before the add
    returns), and forgotten if it never was. An error names the input: `input[i]` for a
    batch. Cancelling aborts them all. `caller`: the tenant and deadline every input runs
    under (appliance/tenancy.py)."""
    tenant = caller.tenant if caller is not None else None
    deadline = caller.deadline if caller is not None else None
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(inputs):
            rid = base_id if len(inputs) == 1 else f"{base_id}-{i}"
            if trace is not None:
                trace[0](rid)
            try:
                stream = await aeng.add_request(
                    prompt, params, rid, priority=priority, arrival_time=arrival_time,
                    tenant=tenant, deadline=deadline,
                )  # fmt: skip
            except BaseException as e:
                if trace is not None:
                    trace[1](rid)
                if isinstance(e, InvalidRequestError):
                    raise _for_input(e, i, len(inputs)) from None
                raise
            streams.append(stream)
        return list(await asyncio.gather(*(s.result() for s in streams)))
    finally:
        for s in streams:
            s.abort()  # a no-op for those that finished


def _for_input(e: InvalidRequestError, i: int, n: int) -> InvalidRequestError:
    """The engine names a prompt's problem `prompt`/`input`: in a batch, `input[i]`."""
    if e.param not in ("prompt", "input"):
        return e
    where = "input" if n == 1 else f"input[{i}]"
    message = str(e)
    for name in ("prompt:", "input:"):
        if message.startswith(name):
            message = message[len(name) :].lstrip()
    err = type(e)(f"{where}: {message}", where)
    return err


def to_base64(vector: Sequence[float]) -> str:
    """The vector as base64 of little-endian float32 (OpenAI's `encoding_format: base64`)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def from_base64(text: str) -> list[float]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))
