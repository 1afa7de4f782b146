"""KServe v2 tensors <-> the Triton vLLM backend's LLM convention.

Inputs (each shape [1], one prompt per request, as Triton's vLLM backend takes them):
  text_input BYTES; stream BOOL; sampling_parameters BYTES (a JSON object of sampling
  fields, values may be strings: {"temperature": "0.1"}); exclude_input_in_output BOOL;
  return_finish_reason / return_num_input_tokens / return_num_output_tokens BOOL.
Outputs: text_output BYTES [n] (plus finish_reason BYTES [n], num_input_tokens UINT32 [1],
num_output_tokens UINT32 [n] when asked for), in `raw_output_contents` as Triton sends them.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from appliance import structured
from appliance.grpc.errors import invalid
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb
from engine.sampling_params import SamplingParams

TEXT_INPUT = "text_input"
_BOOL_INPUTS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
# Declared in ModelMetadata: (name, datatype, shape).
INPUTS = (
    (TEXT_INPUT, "BYTES", [1]),
    ("stream", "BOOL", [1]),
    ("sampling_parameters", "BYTES", [1]),
    *((name, "BOOL", [1]) for name in _BOOL_INPUTS[1:]),
)
_INPUT_NAMES = tuple(name for name, _, _ in INPUTS)
OUTPUTS = (
    ("text_output", "BYTES", [-1]),
    ("finish_reason", "BYTES", [-1]),
    ("num_input_tokens", "UINT32", [1]),
    ("num_output_tokens", "UINT32", [-1]),
)
_FLOATS = {
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
}  # fmt: skip
_INTS = {"n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs"}
_BOOLS = {
    "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens",
}  # fmt: skip
_AS_IS = {"stop", "stop_token_ids", "logit_bias", "allowed_token_ids"}
# Structured outputs, as Triton's vLLM backend reads them: `structured_outputs` (an object,
# or its JSON text) and the older `guided_decoding` (whose `backend` it accepts and drops);
# also vLLM's flat `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
_CONSTRAINT_OBJECTS = {"structured_outputs": frozenset(), "guided_decoding": frozenset({"backend"})}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}  # fmt: skip
_INT_STRING = re.compile(r"-?[0-9]+")


@dataclass
class LLMRequest:
    """One ModelInferRequest, decoded."""

    text: str
    params: SamplingParams
    stream: bool = False
    exclude_input: bool = False
    flags: dict[str, bool] = field(default_factory=dict)  # the return_* inputs
    constraint: structured.Constraint | None = None  # and the key it came from


def encode_bytes(items: list[bytes]) -> bytes:
    """Triton's raw BYTES layout: each element as a 4-byte little-endian length + data."""
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def decode_bytes(raw: bytes, name: str) -> list[bytes]:
    out, i = [], 0
    while i < len(raw):
        if i + 4 > len(raw):
            raise invalid(name, "malformed BYTES tensor")
        (n,) = struct.unpack_from("<I", raw, i)
        i += 4
        if i + n > len(raw):
            raise invalid(name, "malformed BYTES tensor")
        out.append(raw[i : i + n])
        i += n
    return out


def _input_values(req: kpb.ModelInferRequest) -> dict[str, tuple[str, list[Any]]]:
    """name -> (datatype, elements), from raw_input_contents or typed contents."""
    if req.raw_input_contents and len(req.raw_input_contents) != len(req.inputs):
        raise invalid("raw_input_contents", "must hold one entry per input")
    values: dict[str, tuple[str, list[Any]]] = {}
    for k, t in enumerate(req.inputs):
        if t.name not in _INPUT_NAMES:
            known = ", ".join(_INPUT_NAMES)
            raise invalid(t.name, f"unknown input (this model takes {known})")
        if t.name in values:
            raise invalid(t.name, "given more than once")
        if t.datatype not in ("BYTES", "BOOL"):
            raise invalid(t.name, f"datatype {t.datatype} is not supported (BYTES or BOOL)")
        if req.raw_input_contents:
            raw = req.raw_input_contents[k]
            items: list[Any] = (
                decode_bytes(raw, t.name) if t.datatype == "BYTES" else [b != 0 for b in raw]
            )
        elif t.datatype == "BYTES":
            items = list(t.contents.bytes_contents)
        else:
            items = list(t.contents.bool_contents)
        values[t.name] = (t.datatype, items)
    return values


def _single(values: dict[str, tuple[str, list[Any]]], name: str, datatype: str) -> Any:
    if name not in values:
        return None
    dt, items = values[name]
    if dt != datatype:
        raise invalid(name, f"must be {datatype}, got {dt}")
    if len(items) != 1:
        raise invalid(name, f"must hold exactly one element, got {len(items)}")
    return items[0]


def _parse_float(key: str, v: Any) -> float:
    """A number, or a string holding one ("0.1"); never a boolean. Non-finite values pass
    through to SamplingParams, which refuses them naming the field."""
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise invalid(f"sampling_parameters.{key}", f"must be a number, got {v!r:.80}")
    return float(v)


def _parse_int(key: str, v: Any) -> int:
    """An integer, or a string of decimal digits ("16"); never a float (1.9 is not 1) nor a
    boolean (true is not 1)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and _INT_STRING.fullmatch(v):
        return int(v)
    raise invalid(f"sampling_parameters.{key}", f"must be an integer, got {v!r:.80}")


def _parse_bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
        return v.lower() in ("true", "1")
    if isinstance(v, int):
        return bool(v)
    raise invalid(f"sampling_parameters.{key}", f"must be a boolean, got {v!r}")


def _as_is(key: str, v: Any) -> Any:
    """A list/map-valued field, checked for shape here: SamplingParams trusts its types."""
    if isinstance(v, str) and key != "stop":
        v = _loads(v, f"sampling_parameters.{key}")
    if key == "stop":
        ok = isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
        want = "a string or a list of strings"
    elif key == "logit_bias":
        ok = isinstance(v, dict) and all(
            isinstance(b, int | float) and not isinstance(b, bool) for b in v.values()
        )
        want = "an object of token id -> number"
    else:  # stop_token_ids, allowed_token_ids
        ok = isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
        want = "a list of token ids"
    if not ok:
        raise invalid(f"sampling_parameters.{key}", f"must be {want}, got {v!r:.80}")
    return v


def _loads(raw: bytes | str, name: str) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise invalid(name, "not valid JSON: nests too deeply") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of over 4300 digits
        raise invalid(name, f"not valid JSON: {e}") from None


def sampling_from_json(raw: bytes | None) -> tuple[SamplingParams, structured.Constraint | None]:
    """The vLLM backend's `sampling_parameters` JSON; string values are converted.

    Any JSON type can arrive in any key, so every conversion error becomes an
    INVALID_ARGUMENT naming the key, never an exception from deeper in the server."""
    if not raw:
        return SamplingParams(), None
    obj = _loads(raw, "sampling_parameters")
    if not isinstance(obj, dict):
        raise invalid("sampling_parameters", "must be a JSON object")
    kw: dict[str, Any] = {}
    given: list[structured.Given] = []
    for key, v in obj.items():
        try:
            if key in _CONSTRAINT_OBJECTS:
                name = f"sampling_parameters.{key}"
                if isinstance(v, str):
                    v = _loads(v, name)
                given += structured.from_object(v, name, _CONSTRAINT_OBJECTS[key])
            elif key in _GUIDED:
                given.append(structured.Given(f"sampling_parameters.{key}", _GUIDED[key], v))
            elif key in _FLOATS:
                kw[key] = _parse_float(key, v)
            elif key in _INTS:
                kw[key] = None if v is None else _parse_int(key, v)
            elif key in _BOOLS:
                kw[key] = _parse_bool(key, v)
            elif key in _AS_IS:
                kw[key] = _as_is(key, v)
            else:
                raise invalid(f"sampling_parameters.{key}", "unknown sampling parameter")
        except (TypeError, ValueError, OverflowError) as e:
            raise invalid(f"sampling_parameters.{key}", f"bad value {v!r:.80}") from e
    if (c := structured.build(given)) is not None:
        kw["structured_outputs"] = c.params
    return SamplingParams(**kw), c


def parse_request(req: kpb.ModelInferRequest) -> LLMRequest:
    """Decodes the vLLM-backend inputs; raises RpcError (INVALID_ARGUMENT) naming the input."""
    values = _input_values(req)
    text = _single(values, TEXT_INPUT, "BYTES")
    if text is None:
        raise invalid(TEXT_INPUT, "is required")
    try:
        prompt = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(TEXT_INPUT, "must be UTF-8") from e
    flags = {name: bool(_single(values, name, "BOOL")) for name in _BOOL_INPUTS}
    params, constraint = sampling_from_json(_single(values, "sampling_parameters", "BYTES"))
    stream, exclude = flags.pop("stream"), flags.pop("exclude_input_in_output")
    explicit_exclude = "exclude_input_in_output" in values
    if not explicit_exclude:
        exclude = stream  # Triton's vLLM backend: a stream never repeats the prompt
    elif stream and not exclude:
        raise invalid("exclude_input_in_output", "must be true when streaming")
    return LLMRequest(prompt, params, stream, exclude, flags, constraint)


def infer_response(
    req: kpb.ModelInferRequest,
    model: str,
    texts: list[str],
    *,
    finish_reasons: list[str] | None = None,
    num_input_tokens: int | None = None,
    num_output_tokens: list[int] | None = None,
    final: bool | None = None,
) -> kpb.ModelInferResponse:
    """A response with `text_output` and the optional outputs given (None: left out)."""
    resp = kpb.ModelInferResponse(model_name=model, model_version="1", id=req.id)
    tensors: list[tuple[str, str, int, bytes]] = [
        ("text_output", "BYTES", len(texts), encode_bytes([t.encode() for t in texts]))
    ]
    if finish_reasons is not None:
        raw = encode_bytes([r.encode() for r in finish_reasons])
        tensors.append(("finish_reason", "BYTES", len(finish_reasons), raw))
    if num_input_tokens is not None:
        tensors.append(("num_input_tokens", "UINT32", 1, struct.pack("<I", num_input_tokens)))
    if num_output_tokens is not None:
        raw = struct.pack(f"<{len(num_output_tokens)}I", *num_output_tokens)
        tensors.append(("num_output_tokens", "UINT32", len(num_output_tokens), raw))
    for name, datatype, n, raw in tensors:
        resp.outputs.add(name=name, datatype=datatype, shape=[n])
        resp.raw_output_contents.append(raw)
    if final is not None:
        resp.parameters["triton_final_response"].bool_param = final
    return resp
