"""The native `Embed` rpc: every input of one call embedded, batched in the engine.

The same call as HTTP's /v1/embeddings (appliance/embeddings.py): inputs, limits, errors;
here an error is INVALID_ARGUMENT whose field is the proto's (`inputs[i].text`,
`dimensions`, ...), and cancelling the call (or its deadline passing) aborts every input.
Each input's span is recorded as an `embeddings` operation.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc

from appliance import embeddings
from appliance.grpc import errors
from appliance.grpc.errors import RpcError, invalid
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.telemetry import Tracing, record_request_span
from appliance.tenancy import Caller
from engine.errors import InvalidRequestError
from engine.pooling_params import PoolingParams

_PARAMS = ("dimensions", "normalize", "truncate_prompt_tokens")


def _inputs(request: pb.EmbedRequest) -> list[str | list[int]]:
    out: list[str | list[int]] = []
    for i, item in enumerate(request.inputs):
        kind = item.WhichOneof("input")
        if kind == "text":
            out.append(item.text)
        elif kind == "token_ids":
            out.append(list(item.token_ids.ids))
        else:
            raise invalid(f"inputs[{i}]", "one of text or token_ids is required")
    return out


def _field(param: str | None, request: pb.EmbedRequest) -> str:
    """The proto field an engine param names (`input[2]` -> `inputs[2].text`)."""
    if param in _PARAMS:
        return param
    if param is not None and param.startswith("input"):
        index = param[len("input") :]
        if index.startswith("[") and index.endswith("]"):
            item = request.inputs[int(index[1:-1])]
            return f"inputs{index}.{item.WhichOneof('input')}"
        if len(request.inputs) == 1:
            return f"inputs[0].{request.inputs[0].WhichOneof('input')}"
        return "inputs"
    if param in (None, "prompt"):
        return "inputs"
    return param


async def embed(
    aeng: Any,
    served: str,
    request: pb.EmbedRequest,
    context: grpc.aio.ServicerContext,
    tracing: Tracing | None,
    caller: Caller | None = None,
) -> pb.EmbedResponse:
    if request.model not in ("", served):
        raise RpcError(
            grpc.StatusCode.NOT_FOUND, f"model: {request.model!r} is not served here ({served!r})"
        )
    rid = request.request_id or f"grpc-embd-{uuid.uuid4().hex}"
    params: PoolingParams | None = None
    try:
        if aeng.task != "embed":
            raise InvalidRequestError(
                f"model {served!r} has task {aeng.task!r}: it serves generation, not embeddings",
                "model",
            )
        params = PoolingParams(
            dimensions=request.dimensions if request.HasField("dimensions") else None,
            normalize=request.normalize if request.HasField("normalize") else None,
            truncate_prompt_tokens=(
                request.truncate_prompt_tokens
                if request.HasField("truncate_prompt_tokens")
                else None
            ),
        )
        inputs = _inputs(request)
        embeddings.check_inputs(inputs, aeng.config.scheduler.max_queue_len, param="input")
        outs = await embeddings.embed_all(
            aeng, inputs, params, rid, priority=request.priority, caller=caller
        )
    except errors.ENGINE_ERRORS as e:
        err = errors.from_engine_error(e, lambda p: _field(p, request))
        raise err from None
    resp = pb.EmbedResponse(request_id=rid)
    tokens = 0
    metadata = context.invocation_metadata()
    for out in outs:
        resp.embeddings.add(values=out.embedding, prompt_tokens=len(out.prompt_token_ids))
        tokens += len(out.prompt_token_ids)
        record_request_span(
            tracing, metadata, out if tracing else None, operation="embeddings",
            model=served, params=params, request_id=out.request_id,
        )  # fmt: skip
    resp.usage.prompt_tokens = tokens
    return resp
