"""Malformed gRPC calls against the real server: each ends with its own status naming the
problem (INVALID_ARGUMENT messages start with the field's path), the KServe stream reports
errors in-band and goes on, and a Generate stream in flight finishes untouched.

Extends the ten Generate cases of test_grpc_server.py to every rpc of both services, to
bytes that are not a valid message, to oversized messages and metadata, and to KServe's
JSON `sampling_parameters`, which arrive untyped and so reach further than proto fields.
"""

from __future__ import annotations

import asyncio
import json
import math
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
from tests.serving.test_grpc_server import BAD as GENERATE_BAD
from tests.support.grpc_harness import Harness, start_harness
from tests.support.served_stack import tiny_engine, wait_idle_and_free
from tests.support.waiting import StepGate

MAX_RECEIVE = 64 * 1024
EOS_ID = 0  # the tiny tokenizer's <|endoftext|>; checked by test_eos_id_is_the_tiny_models
OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND, EXHAUSTED = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED


def _gen(**sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))


def _chat(*messages: tuple[str, str]) -> pb.Chat:
    return pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])


# (id, request, status, field the message starts with and the BadRequest detail names)
GENERATE: list[tuple[str, pb.GenerateRequest, grpc.StatusCode, str | None]] = [
    ("temperature NaN", _gen(temperature=math.nan), INVALID, "sampling.temperature"),
    ("top_p NaN", _gen(top_p=math.nan), INVALID, "sampling.top_p"),
    ("top_p above 1", _gen(top_p=2.0), INVALID, "sampling.top_p"),
    ("top_k -5", _gen(top_k=-5), INVALID, "sampling.top_k"),
    ("min_p 2", _gen(min_p=2.0), INVALID, "sampling.min_p"),
    ("presence_penalty 3", _gen(presence_penalty=3.0), INVALID, "sampling.presence_penalty"),
    ("frequency_penalty -3", _gen(frequency_penalty=-3.0), INVALID, "sampling.frequency_penalty"),
    ("repetition_penalty 0", _gen(repetition_penalty=0.0), INVALID, "sampling.repetition_penalty"),
    ("repetition_penalty inf", _gen(repetition_penalty=math.inf), INVALID, "sampling.repetition_penalty"),
    ("n 0", _gen(n=0), INVALID, "sampling.n"),
    ("n beyond max_n", _gen(n=5), INVALID, "sampling.n"),
    ("logprobs 21", _gen(logprobs=21), INVALID, "sampling.logprobs"),
    ("17 stop strings", _gen(stop=[f"s{i}" for i in range(17)]), INVALID, "sampling.stop"),
    ("empty stop string", _gen(stop=[""]), INVALID, "sampling.stop"),
    ("stop string over 1024 chars", _gen(stop=["x" * 1025]), INVALID, "sampling.stop"),
    ("1025 distinct stop_token_ids", _gen(stop_token_ids=range(1025)), INVALID, "sampling.stop_token_ids"),
    ("min_tokens above max_tokens", _gen(max_tokens=2, min_tokens=3), INVALID, "sampling.min_tokens"),
    ("logit_bias outside vocab", _gen(logit_bias={600: 1.0}), INVALID, "sampling.logit_bias"),
    ("logit_bias NaN", _gen(logit_bias={5: math.nan}), INVALID, "sampling.logit_bias"),
    ("allowed_token_ids outside vocab", _gen(allowed_token_ids=[600]), INVALID, "sampling.allowed_token_ids"),
    ("text beyond context", pb.GenerateRequest(text="one two " * 200), INVALID, "text"),
    ("token ids beyond context", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 200)), INVALID, "token_ids.ids"),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds()), INVALID, "token_ids.ids"),
    ("chat empty role", pb.GenerateRequest(chat=_chat(("", "hi"))), INVALID, "chat.messages.0.role"),
    ("chat beyond context", pb.GenerateRequest(chat=_chat(("user", "one two " * 200))), INVALID, "chat.messages"),
    ("unknown model", pb.GenerateRequest(model="gpt-9", text="hi"), NOT_FOUND, None),
    # ---- R2 (issue 19, findings 4 and 10): non-finite numbers, empty masks, chat roles -------
    ("temperature inf", _gen(temperature=math.inf), INVALID, "sampling.temperature"),
    ("temperature -inf", _gen(temperature=-math.inf), INVALID, "sampling.temperature"),
    ("top_p inf", _gen(top_p=math.inf), INVALID, "sampling.top_p"),
    ("min_p NaN", _gen(min_p=math.nan), INVALID, "sampling.min_p"),
    ("presence_penalty -inf", _gen(presence_penalty=-math.inf), INVALID, "sampling.presence_penalty"),
    ("frequency_penalty NaN", _gen(frequency_penalty=math.nan), INVALID, "sampling.frequency_penalty"),
    ("logit_bias inf", _gen(logit_bias={5: math.inf}), INVALID, "sampling.logit_bias"),
    ("allowed ids all stop ids under min_tokens", _gen(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2, max_tokens=4), INVALID, "sampling.allowed_token_ids"),
    ("allowed ids all EOS under min_tokens", _gen(allowed_token_ids=[EOS_ID], min_tokens=3, max_tokens=4), INVALID, "sampling.allowed_token_ids"),
    ("chat unknown role", pb.GenerateRequest(chat=_chat(("user", "hi"), ("wizard", "hi"))), INVALID, "chat.messages.1.role"),
    ("chat role in capitals", pb.GenerateRequest(chat=_chat(("USER", "hi"))), INVALID, "chat.messages.0.role"),
    # ---- structured outputs (issue 16) ------------------------------------------------------
    ("json_schema not json", _gen(json_schema="{nope"), INVALID, "sampling.json_schema"),
    ("json_schema a list", _gen(json_schema="[1, 2]"), INVALID, "sampling.json_schema"),
    ("json_schema empty", _gen(json_schema=""), INVALID, "sampling.json_schema"),
    ("regex empty", _gen(regex=""), INVALID, "sampling.regex"),
    ("grammar empty", _gen(grammar=""), INVALID, "sampling.grammar"),
    ("choice empty", _gen(choice=pb.Choices()), INVALID, "sampling.choice"),
    ("choice with an empty string", _gen(choice=pb.Choices(choices=["a", ""])), INVALID, "sampling.choice"),
    # ---- end structured outputs -------------------------------------------------------------
]  # fmt: skip


@pytest.fixture(scope="module")
def harness(tiny_llama_dir: Path) -> Iterator[Harness]:
    h = start_harness(tiny_engine(tiny_llama_dir), max_receive_bytes=MAX_RECEIVE)
    yield h
    h.close()


async def _status(call: Any) -> tuple[grpc.StatusCode, str, str | None]:
    """(code, details, field named by the BadRequest detail) of a finished call."""
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", field_violation(e)
    return OK, "", None


def _assert_names(result: tuple[grpc.StatusCode, str, str | None], code, field) -> None:
    got, details, violation = result
    assert got == code, (got, details)
    if field is not None:
        assert details.startswith(f"{field}:"), details
        assert violation == field, (violation, details)


def test_the_tables_hold_at_least_fifty_cases() -> None:
    assert len(GENERATE) + len(UNARY) + len(KSERVE_SAMPLING) + len(GENERATE_BAD) >= 50


@pytest.mark.parametrize(
    "request_, code, field", [c[1:] for c in GENERATE], ids=[c[0] for c in GENERATE]
)
def test_bad_generate_gets_its_status_naming_the_field(harness, request_, code, field) -> None:
    h = harness

    async def main() -> tuple:
        async with h.channel() as ch:
            return await _status(pb_grpc.ApplianceStub(ch).Generate(request_))

    _assert_names(h.run(main()), code, field)


def _kserve(
    text: bytes | None = b"hi",
    sampling: bytes | None = None,
    model: str = "tiny",
    **bools: bool,
) -> kpb.ModelInferRequest:
    req = kpb.ModelInferRequest(model_name=model, id="1")
    tensors: list[tuple[str, str, bytes]] = []
    if text is not None:
        tensors.append(("text_input", "BYTES", encode_bytes([text])))
    if sampling is not None:
        tensors.append(("sampling_parameters", "BYTES", encode_bytes([sampling])))
    for name, value in bools.items():
        tensors.append((name, "BOOL", bytes([value])))
    for name, datatype, raw in tensors:
        req.inputs.add(name=name, datatype=datatype, shape=[1])
        req.raw_input_contents.append(raw)
    return req


def _sp(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


# KServe's sampling_parameters is JSON: any type can arrive in any field.
KSERVE_SAMPLING: list[tuple[str, bytes, str]] = [
    ("not json", b"{temperature", "sampling_parameters"),
    ("a list", b"[1]", "sampling_parameters"),
    ("nesting bomb", b"[" * 50_000, "sampling_parameters"),
    ("temperature word", _sp(temperature="hot"), "sampling_parameters.temperature"),
    ("temperature object", _sp(temperature={"a": 1}), "sampling_parameters.temperature"),
    ("temperature 10**400", b'{"temperature": 1' + b"0" * 400 + b"}", "sampling_parameters.temperature"),
    ("max_tokens 5000 digits", b'{"max_tokens": ' + b"9" * 5000 + b"}", "sampling_parameters"),
    ("unknown key", _sp(beam_width=2), "sampling_parameters.beam_width"),
    ("ignore_eos word", _sp(ignore_eos="maybe"), "sampling_parameters.ignore_eos"),
    ("stop a number", _sp(stop=5), "sampling_parameters.stop"),
    ("stop list of numbers", _sp(stop=[5]), "sampling_parameters.stop"),
    ("stop_token_ids a number", _sp(stop_token_ids=5), "sampling_parameters.stop_token_ids"),
    ("stop_token_ids strings", _sp(stop_token_ids=["a"]), "sampling_parameters.stop_token_ids"),
    ("17 stop strings", _sp(stop=[f"s{i}" for i in range(17)]), "sampling_parameters.stop"),
    ("stop string over 1024 chars", _sp(stop=["x" * 1025]), "sampling_parameters.stop"),
    ("1025 distinct stop_token_ids", _sp(stop_token_ids=list(range(1025))), "sampling_parameters.stop_token_ids"),
    ("logit_bias a list", _sp(logit_bias=[1, 2]), "sampling_parameters.logit_bias"),
    ("logit_bias bad key", _sp(logit_bias={"abc": 1}), "sampling_parameters.logit_bias"),
    ("allowed_token_ids a number", _sp(allowed_token_ids=5), "sampling_parameters.allowed_token_ids"),
    ("allowed_token_ids nested json", _sp(allowed_token_ids="[[1]]"), "sampling_parameters.allowed_token_ids"),
    ("top_p out of range", _sp(top_p=5), "sampling_parameters.top_p"),
    ("max_tokens beyond context", _sp(max_tokens=1000), "sampling_parameters.max_tokens"),
    # ---- R2 (issue 19, findings 4 and 10) ----------------------------------------------------
    ("temperature string inf", _sp(temperature="inf"), "sampling_parameters.temperature"),
    ("temperature string nan", _sp(temperature="nan"), "sampling_parameters.temperature"),
    ("temperature 1e400", b'{"temperature": 1e400}', "sampling_parameters.temperature"),
    ("top_p string -inf", _sp(top_p="-inf"), "sampling_parameters.top_p"),
    ("repetition_penalty string Infinity", _sp(repetition_penalty="Infinity"), "sampling_parameters.repetition_penalty"),
    ("temperature true", _sp(temperature=True), "sampling_parameters.temperature"),
    ("logit_bias value 1e400", b'{"logit_bias": {"5": 1e400}}', "sampling_parameters.logit_bias"),
    ("n 1.9", _sp(n=1.9), "sampling_parameters.n"),
    ("n string 1.9", _sp(n="1.9"), "sampling_parameters.n"),
    ("max_tokens true", _sp(max_tokens=True), "sampling_parameters.max_tokens"),
    ("min_tokens 2.0", _sp(min_tokens=2.0), "sampling_parameters.min_tokens"),
    ("top_k string 5_0", _sp(top_k="5_0"), "sampling_parameters.top_k"),
    ("seed 2**63", _sp(seed=2**63), "sampling_parameters.seed"),
    ("seed string 2**64", _sp(seed=str(2**64)), "sampling_parameters.seed"),
    ("seed below -2**63", _sp(seed=-(2**63) - 1), "sampling_parameters.seed"),
    ("logit_bias key with a space", _sp(logit_bias={" 5": 1}), "sampling_parameters.logit_bias"),
    ("logit_bias key with a plus", _sp(logit_bias={"+5": 1}), "sampling_parameters.logit_bias"),
    ("logit_bias key with an underscore", _sp(logit_bias={"5_0": 1}), "sampling_parameters.logit_bias"),
    ("logit_bias key in arabic digits", _sp(logit_bias={"\u0665": 1}), "sampling_parameters.logit_bias"),
    ("logit_bias key with a leading zero", _sp(logit_bias={"5": 1, "05": -1}), "sampling_parameters.logit_bias"),
    ("allowed ids all EOS under min_tokens", _sp(allowed_token_ids=[EOS_ID], min_tokens=3, max_tokens=4), "sampling_parameters.allowed_token_ids"),
    # ---- structured outputs (issue 16) ------------------------------------------------------
    ("structured_outputs not an object", _sp(structured_outputs=5), "sampling_parameters.structured_outputs"),
    ("structured_outputs text not json", _sp(structured_outputs="{nope"), "sampling_parameters.structured_outputs"),
    ("structured_outputs empty", _sp(structured_outputs={}), "sampling_parameters.structured_outputs"),
    ("structured_outputs unknown key", _sp(structured_outputs={"backend": "x"}), "sampling_parameters.structured_outputs"),
    ("structured_outputs two kinds", _sp(structured_outputs={"regex": "a", "choice": ["a"]}), "sampling_parameters.structured_outputs.choice"),
    ("structured_outputs choice empty", _sp(structured_outputs=json.dumps({"choice": []})), "sampling_parameters.structured_outputs.choice"),
    ("guided_decoding json a list", _sp(guided_decoding={"json": [1]}), "sampling_parameters.guided_decoding.json"),
    ("guided_json a number", _sp(guided_json=5), "sampling_parameters.guided_json"),
    ("guided_regex a list", _sp(guided_regex=["a"]), "sampling_parameters.guided_regex"),
    ("guided_json and guided_regex", _sp(guided_json={"type": "object"}, guided_regex="a"), "sampling_parameters.guided_regex"),
    # ---- end structured outputs -------------------------------------------------------------
]  # fmt: skip


@pytest.mark.parametrize(
    "sampling, field", [c[1:] for c in KSERVE_SAMPLING], ids=[c[0] for c in KSERVE_SAMPLING]
)
def test_bad_kserve_sampling_parameters_are_invalid_argument_naming_the_key(
    harness, sampling, field
) -> None:  # fmt: skip
    h = harness

    async def main() -> tuple:
        async with h.channel() as ch:
            stub = kpb_grpc.GRPCInferenceServiceStub(ch)
            return await _status(stub.ModelInfer(_kserve(sampling=sampling)))

    _assert_names(h.run(main()), INVALID, field)


def _unary_cases() -> list[tuple[str, str, Any, grpc.StatusCode, str | None]]:
    k = kpb
    return [
        ("tokenize nothing", "Tokenize", pb.TokenizeRequest(), INVALID, "input"),
        ("tokenize empty chat", "Tokenize", pb.TokenizeRequest(chat=pb.Chat()), INVALID, "chat.messages"),
        ("tokenize unknown model", "Tokenize", pb.TokenizeRequest(model="x", text="a"), NOT_FOUND, None),
        ("detokenize outside vocab", "Detokenize", pb.DetokenizeRequest(token_ids=[600]), INVALID, "token_ids"),
        ("detokenize unknown model", "Detokenize", pb.DetokenizeRequest(model="x"), NOT_FOUND, None),
        ("abort unknown id", "Abort", pb.AbortRequest(request_id="nope"), NOT_FOUND, None),
        ("kserve unknown model", "ModelInfer", _kserve(model="gpt-9"), NOT_FOUND, None),
        ("kserve unknown version", "ModelMetadata", k.ModelMetadataRequest(name="tiny", version="7"), NOT_FOUND, None),
        ("kserve no text_input", "ModelInfer", _kserve(text=None), INVALID, "text_input"),
        ("kserve text not utf-8", "ModelInfer", _kserve(text=b"\xff\xfe"), INVALID, "text_input"),
        ("kserve empty text", "ModelInfer", _kserve(text=b""), INVALID, "text_input"),
        ("kserve stream on unary", "ModelInfer", _kserve(stream=True), INVALID, "stream"),
        ("kserve stream without exclude", "ModelInfer", _kserve(stream=True, exclude_input_in_output=False), INVALID, "exclude_input_in_output"),
        ("kserve malformed BYTES", "ModelInfer", _broken_bytes_tensor(), INVALID, "text_input"),
        ("kserve contents count", "ModelInfer", _contents_mismatch(), INVALID, "raw_input_contents"),
        ("kserve FP32 input", "ModelInfer", _fp32_input(), INVALID, "text_input"),
        # ---- R2 (issue 19, finding 10) -------------------------------------------------------
        ("kserve unknown input", "ModelInfer", _with_input(_kserve(), "return_logprobs", "BOOL", b"\x01"), INVALID, "return_logprobs"),
        ("kserve duplicate text_input", "ModelInfer", _with_input(_kserve(), "text_input", "BYTES", encode_bytes([b"override"])), INVALID, "text_input"),
    ]  # fmt: skip


def _with_input(req: kpb.ModelInferRequest, name: str, datatype: str, raw: bytes):
    """`req` with one more raw input tensor."""
    req.inputs.add(name=name, datatype=datatype, shape=[1])
    req.raw_input_contents.append(raw)
    return req


def _broken_bytes_tensor() -> kpb.ModelInferRequest:
    req = kpb.ModelInferRequest(model_name="tiny")
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    req.raw_input_contents.append(b"\xff\x00\x00\x00ab")  # claims 255 bytes, holds 2
    return req


def _contents_mismatch() -> kpb.ModelInferRequest:
    req = _kserve()
    req.raw_input_contents.append(b"extra")
    return req


def _fp32_input() -> kpb.ModelInferRequest:
    req = kpb.ModelInferRequest(model_name="tiny")
    req.inputs.add(name="text_input", datatype="FP32", shape=[1])
    req.raw_input_contents.append(b"\x00\x00\x80\x3f")
    return req


UNARY = _unary_cases()


@pytest.mark.parametrize(
    "method, request_, code, field", [c[1:] for c in UNARY], ids=[c[0] for c in UNARY]
)
def test_bad_unary_call_gets_its_status_naming_the_field(
    harness, method, request_, code, field
) -> None:
    h = harness

    async def main() -> tuple:
        async with h.channel() as ch:
            native = method in ("Tokenize", "Detokenize", "Abort")
            stub = pb_grpc.ApplianceStub(ch) if native else kpb_grpc.GRPCInferenceServiceStub(ch)
            return await _status(getattr(stub, method)(request_))

    _assert_names(h.run(main()), code, field)


def test_eos_id_is_the_tiny_models(harness) -> None:
    assert harness.engine.engine.tokenizer.eos_token_ids == {EOS_ID}


def test_native_chat_reads_developer_as_system_as_http_does(harness) -> None:
    h = harness

    async def main() -> tuple:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            dev = await stub.Tokenize(
                pb.TokenizeRequest(chat=_chat(("developer", "be"), ("user", "hi")))
            )
            sys = await stub.Tokenize(
                pb.TokenizeRequest(chat=_chat(("system", "be"), ("user", "hi")))
            )
            return list(dev.token_ids), list(sys.token_ids)

    dev, sys = h.run(main())
    assert dev == sys


def test_bytes_that_are_not_a_message_are_invalid_argument(harness) -> None:
    h = harness
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length 2**32-1, then nothing

    async def main() -> list[tuple]:
        async with h.channel() as ch:
            gen = ch.unary_stream("/appliance.v1.Appliance/Generate")
            tok = ch.unary_unary("/appliance.v1.Appliance/Tokenize")
            stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
            bad_utf8 = b"\x12\x02\xff\xfe"  # GenerateRequest.text = b"\xff\xfe"
            return [await _status(gen(garbage)), await _status(tok(garbage)),
                    await _status(gen(bad_utf8)), await _status(stream(iter([garbage])))]  # fmt: skip

    for code, details, _ in h.run(main()):
        assert code == INVALID, (code, details)
        assert "request" in details.lower(), details


def test_oversized_message_and_metadata_are_refused_before_any_handler(harness) -> None:
    h = harness

    async def main() -> list[tuple]:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            big = pb.GenerateRequest(text="x" * (MAX_RECEIVE + 1))
            huge_md = (("x-junk", "y" * 64 * 1024),)
            return [
                await _status(stub.Generate(big)),
                await _status(stub.Tokenize(pb.TokenizeRequest(text="a"), metadata=huge_md)),
                await _status(stub.Tokenize(pb.TokenizeRequest(text="a"))),
            ]

    message, metadata, after = h.run(main())
    assert message[0] == EXHAUSTED, message
    assert metadata[0] in (EXHAUSTED, grpc.StatusCode.INTERNAL), metadata  # the client may refuse
    assert after[0] == OK


def test_unknown_method_is_unimplemented(harness) -> None:
    h = harness

    async def main() -> tuple:
        async with h.channel() as ch:
            return await _status(ch.unary_unary("/appliance.v1.Appliance/NoSuchMethod")(b""))

    assert h.run(main())[0] == grpc.StatusCode.UNIMPLEMENTED


def test_duplicate_request_id_in_flight_is_invalid_argument(harness) -> None:
    h = harness

    async def main() -> tuple:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            params = pb.SamplingParams(max_tokens=50, ignore_eos=True)
            first = stub.Generate(pb.GenerateRequest(text="a", request_id="dup", sampling=params))
            await first.read()
            second = await _status(stub.Generate(pb.GenerateRequest(text="b", request_id="dup")))
            gate.open()
            last = None
            while (r := await first.read()) is not grpc.aio.EOF:
                last = r
            return second, last.finish_reason

    with StepGate(h.engine.engine, permits=1) as gate:  # "dup" stays in flight until opened
        second, finish = h.run(main())
    _assert_names(second, INVALID, "request_id")
    assert finish == "length"


def test_kserve_stream_reports_errors_in_band_and_serves_the_rest(harness) -> None:
    h = harness
    good = _kserve(stream=True, sampling=_sp(max_tokens=3, ignore_eos=True))
    good.id = "good"
    bad = [_kserve(sampling=s, stream=True) for _, s, _ in KSERVE_SAMPLING[:6]]
    for i, r in enumerate(bad):
        r.id = f"bad-{i}"

    async def main() -> list:
        async with h.channel() as ch:
            stub = kpb_grpc.GRPCInferenceServiceStub(ch)
            return [r async for r in stub.ModelStreamInfer(iter([*bad, good]))]

    responses = h.run(main())
    errors = {r.infer_response.id: r.error_message for r in responses if r.error_message}
    assert sorted(errors) == sorted(r.id for r in bad)
    assert all(m.startswith("sampling_parameters") for m in errors.values()), errors
    assert any(r.infer_response.id == "good" and not r.error_message for r in responses)


def test_a_stream_in_flight_finishes_untouched_by_every_bad_call(harness) -> None:
    h = harness
    greedy = pb.SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    request = pb.GenerateRequest(text="Once upon a time", sampling=greedy)

    async def main() -> tuple[list[int], list[int], list, bool]:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            kstub = kpb_grpc.GRPCInferenceServiceStub(ch)
            expected = [t async for r in stub.Generate(request) for t in r.token_ids]
            gate.close()  # one token, then held: the stream outlasts every bad call
            gate.allow(1)
            call = stub.Generate(request)
            got = list((await call.read()).token_ids)
            bad = [stub.Generate(c[1]) for c in GENERATE + GENERATE_BAD]
            bad += [getattr(stub if m in ("Tokenize", "Detokenize", "Abort") else kstub, m)(r)
                    for _, m, r, _, _ in UNARY]  # fmt: skip
            bad += [kstub.ModelInfer(_kserve(sampling=s)) for _, s, _ in KSERVE_SAMPLING]
            codes = [c for c, _, _ in await asyncio.gather(*[_status(b) for b in bad])]
            overlapped = h.engine.num_in_flight == 1
            gate.open()
            while (r := await call.read()) is not grpc.aio.EOF:
                got += r.token_ids
            return expected, got, codes, overlapped

    with StepGate(h.engine.engine, permits=None) as gate:
        expected, got, codes, overlapped = h.run(main())
    assert OK not in codes and grpc.StatusCode.INTERNAL not in codes, codes
    assert overlapped, "the stream ended before the bad calls did"
    assert got == expected
    wait_idle_and_free(h.engine)
