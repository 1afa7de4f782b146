"""Structured outputs on gRPC: the native `SamplingParams.structured_outputs` oneof and
KServe's `sampling_parameters` keys (Triton's vLLM backend spelling) become the engine's
`SamplingParams.structured_outputs`; engine refusals name the field the client wrote.

The mapping is checked as the server hands it to the engine (a recording wrapper around
`AsyncEngine.add_request`) on a real server with the tiny checkpoint; the bad-value rows are
in test_bad_input_grpc.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from appliance.grpc.errors import field_violation
from appliance.grpc.kserve_tensors import encode_bytes
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb
from appliance.grpc.proto.inference import grpc_service_pb2_grpc as kpb_grpc
from engine import StructuredOutputsParams
from engine.sampling_params import SamplingParams, SamplingParamsError
from tests.support.grpc_harness import Harness, start_harness
from tests.support.served_stack import tiny_engine

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class Recorder:
    """Wraps the harness engine's add_request: keeps each request's params, and raises
    `refuse` instead of queueing when set (as the grammar engine does at admission)."""

    def __init__(self, h: Harness):
        self.seen: list[SamplingParams] = []
        self.refuse: SamplingParamsError | None = None
        self._inner = h.engine.add_request
        h.engine.add_request = self.add_request  # type: ignore[method-assign]

    async def add_request(self, prompt: Any, params: SamplingParams, *a: Any, **kw: Any) -> Any:
        if self.refuse is not None:
            raise self.refuse
        self.seen.append(params)
        return await self._inner(prompt, params, *a, **kw)


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> Iterator[tuple[Harness, Recorder]]:
    h = start_harness(tiny_engine(tiny_llama_dir))
    rec = Recorder(h)
    yield h, rec
    h.close()


@pytest.fixture
def h(served) -> Iterator[tuple[Harness, Recorder]]:
    h, rec = served
    rec.seen.clear()
    rec.refuse = None
    yield h, rec


def _generate(h: Harness, **oneof: Any) -> tuple[grpc.StatusCode, str, str | None]:
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2, **oneof))

    async def main():
        async with h.channel() as ch:
            try:
                [r async for r in pb_grpc.ApplianceStub(ch).Generate(request)]
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details(), field_violation(e)
        return grpc.StatusCode.OK, "", None

    return h.run(main())


def _infer(h: Harness, sampling: dict[str, Any]) -> tuple[grpc.StatusCode, str]:
    req = kpb.ModelInferRequest(model_name="tiny", id="1")
    for name, datatype, raw in (
        ("text_input", "BYTES", encode_bytes([b"hi"])),
        ("sampling_parameters", "BYTES", encode_bytes([json.dumps(sampling).encode()])),
    ):
        req.inputs.add(name=name, datatype=datatype, shape=[1])
        req.raw_input_contents.append(raw)

    async def main():
        async with h.channel() as ch:
            try:
                await kpb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
        return grpc.StatusCode.OK, ""

    return h.run(main())


NATIVE = [
    ("json_schema", {"json_schema": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
    ("json_object", {"json_object": True}, StructuredOutputsParams(json_object=True)),
    ("json_object false", {"json_object": False}, None),
    ("regex", {"regex": "[ab]+"}, StructuredOutputsParams(regex="[ab]+")),
    ("choice", {"choice": pb.Choices(choices=["x", "y"])}, StructuredOutputsParams(choice=("x", "y"))),
    ("grammar", {"grammar": 'start: "a"'}, StructuredOutputsParams(grammar='start: "a"')),
    ("none", {}, None),
]  # fmt: skip


@pytest.mark.parametrize("oneof, want", [c[1:] for c in NATIVE], ids=[c[0] for c in NATIVE])
def test_native_oneof_reaches_the_engine_as_the_constraint(h, oneof, want) -> None:
    harness, rec = h
    assert _generate(harness, **oneof)[0] == grpc.StatusCode.OK
    assert [p.structured_outputs for p in rec.seen] == [want]


KSERVE = [
    ("structured_outputs as JSON text", {"structured_outputs": json.dumps({"json": SCHEMA})}, StructuredOutputsParams(json=SCHEMA)),
    ("structured_outputs object", {"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=("a", "b"))),
    ("guided_decoding with backend", {"guided_decoding": {"regex": "a+", "backend": "xgrammar"}}, StructuredOutputsParams(regex="a+")),
    ("guided_decoding as JSON text", {"guided_decoding": json.dumps({"json_object": True})}, StructuredOutputsParams(json_object=True)),
    ("guided_json", {"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ("guided_grammar", {"guided_grammar": 'start: "b"'}, StructuredOutputsParams(grammar='start: "b"')),
    ("with other fields", {"temperature": "0", "guided_choice": ["z"]}, StructuredOutputsParams(choice=("z",))),
]  # fmt: skip


@pytest.mark.parametrize("sampling, want", [c[1:] for c in KSERVE], ids=[c[0] for c in KSERVE])
def test_kserve_sampling_parameters_reach_the_engine_as_the_constraint(h, sampling, want) -> None:
    harness, rec = h
    assert _infer(harness, {"max_tokens": 2, **sampling}) == (grpc.StatusCode.OK, "")
    assert [p.structured_outputs for p in rec.seen] == [want]


def test_a_constraint_the_grammar_engine_refuses_names_the_clients_field(h) -> None:
    harness, rec = h
    rec.refuse = SamplingParamsError("does not compile", "structured_outputs.regex")
    code, details, field = _generate(harness, regex="(")
    assert (code, details, field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling.regex: does not compile",
        "sampling.regex",
    )
    rec.refuse = SamplingParamsError("does not compile", "structured_outputs.json")
    code, details = _infer(harness, {"guided_decoding": {"json": SCHEMA}})
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "sampling_parameters.guided_decoding.json: does not compile"
