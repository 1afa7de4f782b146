"""KServe v2 inference on an embedding model: texts in, an FP32 tensor of embeddings out.

Input: `text_input` BYTES [N] (N texts, each UTF-8; raw_input_contents or bytes_contents).
Request parameters (optional): `dimensions` (int64), `normalize` (bool),
`truncate_prompt_tokens` (int64), as in /v1/embeddings.
Outputs: `embedding` FP32 [N, D] (row-major little-endian float32 in raw_output_contents,
one row per text, in order) and `num_input_tokens` UINT32 [N].
The call itself is the one every frontend makes (appliance/embeddings.py); errors are
INVALID_ARGUMENT naming the input (`text_input[i]`) or the parameter.
"""

from __future__ import annotations

import struct
import uuid
from typing import Any

from appliance import embeddings
from appliance.grpc.errors import invalid
from appliance.grpc.kserve_tensors import decode_bytes
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb
from appliance.tenancy import Caller
from engine.pooling_params import PoolingParams

TEXT_INPUT = "text_input"
INPUTS = ((TEXT_INPUT, "BYTES", [-1]),)
OUTPUTS = (("embedding", "FP32", [-1, -1]), ("num_input_tokens", "UINT32", [-1]))
_INT_PARAMS = ("dimensions", "truncate_prompt_tokens")


def parse_texts(req: kpb.ModelInferRequest) -> list[str]:
    """The `text_input` tensor's texts; INVALID_ARGUMENT naming what is wrong."""
    if req.raw_input_contents and len(req.raw_input_contents) != len(req.inputs):
        raise invalid("raw_input_contents", "must hold one entry per input")
    texts: list[bytes] | None = None
    for k, t in enumerate(req.inputs):
        if t.name != TEXT_INPUT:
            raise invalid(t.name, f"unknown input (an embedding model takes {TEXT_INPUT} only)")
        if t.datatype != "BYTES":
            raise invalid(TEXT_INPUT, f"must be BYTES, got {t.datatype}")
        if texts is not None:
            raise invalid(TEXT_INPUT, "given more than once")
        if req.raw_input_contents:
            texts = decode_bytes(req.raw_input_contents[k], TEXT_INPUT)
        else:
            texts = list(t.contents.bytes_contents)
    if texts is None:
        raise invalid(TEXT_INPUT, "is required")
    out = []
    for i, b in enumerate(texts):
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            raise invalid(f"{TEXT_INPUT}[{i}]", "must be UTF-8") from None
    return out


def parse_params(req: kpb.ModelInferRequest) -> PoolingParams:
    kw: dict[str, Any] = {}
    for name in _INT_PARAMS:
        p = req.parameters.get(name)
        if p is not None:
            if p.WhichOneof("parameter_choice") != "int64_param":
                raise invalid(f"parameters.{name}", "must be an int64 parameter")
            kw[name] = p.int64_param
    p = req.parameters.get("normalize")
    if p is not None:
        if p.WhichOneof("parameter_choice") != "bool_param":
            raise invalid("parameters.normalize", "must be a bool parameter")
        kw["normalize"] = p.bool_param
    return PoolingParams(**kw)


def field_of(param: str | None) -> str:
    """An engine param as this protocol names it."""
    if param in _INT_PARAMS or param == "normalize":
        return f"parameters.{param}"
    if param is not None and param.startswith("input"):
        return TEXT_INPUT + param[len("input") :]
    return TEXT_INPUT if param in (None, "prompt") else param


async def infer(
    aeng: Any, req: kpb.ModelInferRequest, model: str, caller: Caller | None = None
) -> kpb.ModelInferResponse:
    """One ModelInfer on an embedding model (raises RpcError or the engine's errors).
    `caller`: the tenant and deadline its inputs run under."""
    texts = parse_texts(req)
    params = parse_params(req)
    embeddings.check_inputs(texts, aeng.config.scheduler.max_queue_len)
    rid = f"kserve-embd-{uuid.uuid4().hex}"
    outs = await embeddings.embed_all(aeng, texts, params, rid, caller=caller)
    width = len(outs[0].embedding)
    raw = b"".join(struct.pack(f"<{width}f", *o.embedding) for o in outs)
    counts = [len(o.prompt_token_ids) for o in outs]
    resp = kpb.ModelInferResponse(model_name=model, model_version="1", id=req.id)
    resp.outputs.add(name="embedding", datatype="FP32", shape=[len(outs), width])
    resp.raw_output_contents.append(raw)
    resp.outputs.add(name="num_input_tokens", datatype="UINT32", shape=[len(outs)])
    resp.raw_output_contents.append(struct.pack(f"<{len(counts)}I", *counts))
    return resp
