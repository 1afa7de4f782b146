"""POST /v1/embeddings: OpenAI's embeddings API on an embedding model.

Every input becomes its own engine request (batched by the engine's prefill steps); the
answer comes once all are done, in input order, as floats or base64 (`encoding_format`).
A generation model answers 400 naming its task; so does any bad field, an empty input or
one over the context (`context_length_exceeded`), each error naming `input[i]` in a batch.
A client that leaves before the answer aborts every input (a bare 499).
"""

from __future__ import annotations

import logging
import time
import uuid

import pydantic_core
from starlette.requests import Request
from starlette.responses import Response

from appliance import embeddings
from appliance.http.body import read_json
from appliance.http.caller import caller_of
from appliance.http.embedding_models import EmbeddingRequest
from appliance.http.errors import UNAVAILABLE, APIError, bad_request, from_engine_error
from appliance.http.serving import ClientGone, state_of, until_disconnect
from engine.errors import InvalidRequestError
from engine.pooling_params import PoolingParams

logger = logging.getLogger("appliance.http")


async def create_embedding(request: Request) -> Response:
    arrival = time.monotonic()
    state = state_of(request)
    req = await read_json(
        request, EmbeddingRequest, state.server.max_request_body, state.server.body_timeout_s,
        offload=state.aeng.offload_if_large,
    )  # fmt: skip
    if state.resolve_model(req.model) is not None:  # a LoRA adapter's name
        raise bad_request("LoRA adapters do not serve embeddings", "model")
    if state.shutting_down:
        raise APIError(503, "the server is shutting down", type_=UNAVAILABLE, code="shutting_down")
    aeng = state.aeng
    rid = f"embd-{uuid.uuid4().hex}"
    try:
        if aeng.task != "embed":  # before reading the inputs: the task is the answer
            raise InvalidRequestError(
                f"model {state.model_name!r} has task {aeng.task!r}: it serves generation, not "
                "embeddings (start an embedding model: model.task embed)",
                "model",
            )
        params = PoolingParams(
            dimensions=req.dimensions,
            normalize=req.normalize,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        inputs = embeddings.inputs_of(req.input)
        embeddings.check_inputs(inputs, aeng.config.scheduler.max_queue_len)
        tracer, headers = state.tracer, dict(request.headers)
        trace = None
        if tracer is not None:
            trace = (lambda r: tracer.register(r, headers, params, "embeddings"), tracer.forget)
        call = embeddings.embed_all(
            aeng, inputs, params, rid, priority=req.priority, arrival_time=arrival, trace=trace,
            caller=caller_of(request, state, arrival),
        )  # fmt: skip
        outs = await until_disconnect(request, call, [])
    except ClientGone:
        return Response(status_code=499)
    except Exception as e:
        raise from_engine_error(e) from None
    data = [
        {
            "index": i,
            "object": "embedding",
            "embedding": out.embedding
            if req.encoding_format == "float"
            else embeddings.to_base64(out.embedding),
        }
        for i, out in enumerate(outs)
    ]
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    body = {
        "id": rid,
        "object": "list",
        "created": int(time.time()),
        "model": state.response_model(req.model),
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    logger.info(
        "embedding done",
        extra={"fields": {"request_id": rid, "inputs": len(outs), "prompt_tokens": tokens}},
    )
    return Response(
        pydantic_core.to_json(body),
        media_type="application/json",
        headers={"X-Request-Id": rid},
    )
