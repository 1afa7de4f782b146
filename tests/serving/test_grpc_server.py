"""The native gRPC service against the real tiny engine, over 127.0.0.1 with grpc.aio.

Streaming output equals the offline engine's greedy output token for token; cancelling a
call, its deadline or the Abort rpc free the request's KV blocks with no further step; every
bad input gets its status naming the field; health and reflection answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from appliance.grpc.errors import field_violation
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from tests.support.grpc_harness import (
    PROMPTS,
    Harness,
    offline_greedy,
    start_harness,
    tiny_llm_engine,
)
from tests.support.waiting import HANG_S, StepGate, wait_for, wait_for_async

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> Iterator[tuple[Harness, list]]:
    llm_engine = tiny_llm_engine(tiny_llama_dir)
    chat_ids = llm_engine.tokenizer.apply_chat_template(CHAT)
    expected = offline_greedy(llm_engine, [*PROMPTS, chat_ids], MAX_TOKENS)
    h = start_harness(llm_engine)
    yield h, expected
    h.close()


def _greedy(max_tokens: int = MAX_TOKENS, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def _collect(stub, request, **kw) -> list[pb.GenerateResponse]:
    return [r async for r in stub.Generate(request, **kw)]


def _free_blocks(h: Harness) -> int:
    return h.engine.stats().num_free_blocks


def test_streamed_generation_equals_the_offline_engines_greedy_output(served) -> None:
    h, expected = served

    async def main() -> list:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            reqs = [pb.GenerateRequest(text=p, sampling=_greedy()) for p in PROMPTS]
            reqs.append(pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in CHAT]),
                                           sampling=_greedy()))  # fmt: skip
            return await asyncio.gather(*[_collect(stub, r) for r in reqs])

    for responses, (ids, text) in zip(h.run(main()), expected, strict=True):
        assert [t for r in responses for t in r.token_ids] == ids
        assert "".join(r.text for r in responses) == text
        assert [r.finish_reason for r in responses] == [""] * (len(responses) - 1) + ["length"]
        assert [r.HasField("usage") for r in responses][-1]
        assert not any(r.HasField("usage") for r in responses[:-1])
        assert responses[-1].usage.completion_tokens == MAX_TOKENS
        assert len({r.request_id for r in responses}) == 1


def test_a_client_that_keeps_up_gets_one_response_per_token(served) -> None:
    """Streamed, not one blob: the engine steps only after the client read the previous
    response (a client slower than the engine gets fewer, larger deltas instead)."""
    h, expected = served

    async def main() -> list:
        async with h.channel() as ch:
            call = pb_grpc.ApplianceStub(ch).Generate(
                pb.GenerateRequest(text=PROMPTS[0], sampling=_greedy())
            )
            responses = []
            while (r := await call.read()) is not grpc.aio.EOF:
                responses.append(r)
                gate.allow(1)
            return responses

    with StepGate(h.engine.engine, permits=1) as gate:
        responses = h.run(main())
    assert [list(r.token_ids) for r in responses] == [[t] for t in expected[0][0]]
    assert "".join(r.text for r in responses) == expected[0][1]
    assert responses[0].HasField("usage") is False and responses[-1].finish_reason == "length"


def test_token_id_prompt_and_n_samples_report_indices_and_summed_usage(served) -> None:
    h, expected = served
    prompt_ids = h.engine.engine.tokenizer.encode(PROMPTS[0])

    async def main() -> tuple[list, list]:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            by_ids = await _collect(stub, pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt_ids), sampling=_greedy()))  # fmt: skip
            sampled = await _collect(stub, pb.GenerateRequest(
                text=PROMPTS[1], request_id="n2",
                sampling=pb.SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True),
            ))  # fmt: skip
            with_lp = await _collect(stub, pb.GenerateRequest(
                text=PROMPTS[0], sampling=_greedy(3, logprobs=2)))  # fmt: skip
            return by_ids, sampled, with_lp

    by_ids, sampled, with_lp = h.run(main())
    for r in with_lp:
        assert [lp.token_id for lp in r.logprobs] == list(r.token_ids)
        assert all(len(lp.top) == 2 and lp.rank >= 1 for lp in r.logprobs)
    assert [t for r in by_ids for t in r.token_ids] == expected[0][0]
    assert {r.index for r in sampled} == {0, 1}
    finished = sorted((r.index, r.finish_reason) for r in sampled if r.finish_reason)
    assert finished == [(0, "length"), (1, "length")]
    assert sampled[-1].usage.completion_tokens == 8 and sampled[-1].request_id == "n2"
    assert all(len([t for r in sampled if r.index == i for t in r.token_ids]) == 4 for i in (0, 1))


def test_cancelling_the_call_aborts_the_request_and_frees_its_blocks(served) -> None:
    h, _ = served
    before = _free_blocks(h)

    async def main() -> None:
        async with h.channel() as ch:
            call = pb_grpc.ApplianceStub(ch).Generate(
                pb.GenerateRequest(text=PROMPTS[0], sampling=_greedy(400))
            )
            for i in range(3):
                await call.read()
                if i < 2:
                    gate.allow(1)
            await wait_for_async(lambda: _free_blocks(h) < before, "the request holding blocks")
            call.cancel()

    # A step per response read, none after the third: the request cannot finish, and the
    # blocks come back while no step runs (the abort itself frees them).
    with StepGate(h.engine.engine, permits=1) as gate:
        h.run(main())
        wait_for(lambda: _free_blocks(h) == before and h.engine.num_in_flight == 0, "blocks freed")


def test_a_passed_deadline_aborts_the_request_and_frees_its_blocks(served) -> None:
    """Steps are held after the first token, so the deadline passes before the request can
    finish, however fast the box. The deadline is doubled until the first token arrives
    before it (a slow box), so the request surely holds blocks when it passes."""
    h, _ = served
    before = _free_blocks(h)

    async def main(timeout: float) -> tuple[bool, grpc.StatusCode]:
        started = False
        async with h.channel() as ch:
            req = pb.GenerateRequest(text=PROMPTS[1], sampling=_greedy(400))
            call = pb_grpc.ApplianceStub(ch).Generate(req, timeout=timeout)
            try:
                await call.read()  # the first token: the request is running, holding blocks
                started = True
                await call.read()  # held: only the deadline can end this
            except grpc.aio.AioRpcError as e:
                return started, e.code()
            return started, grpc.StatusCode.OK

    timeout = 0.3
    while True:
        with StepGate(h.engine.engine, permits=1):
            started, code = h.run(main(timeout))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_for(lambda: _free_blocks(h) == before and h.engine.num_in_flight == 0,
                     "blocks freed")  # fmt: skip
        if started:
            break
        timeout *= 2
        assert timeout < HANG_S, "the first token never arrived"


def test_abort_rpc_ends_the_stream_with_finish_reason_abort(served) -> None:
    h, _ = served
    before = _free_blocks(h)

    async def main() -> tuple[list, grpc.StatusCode]:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            call = stub.Generate(pb.GenerateRequest(text=PROMPTS[0], request_id="to-abort",
                                                    sampling=_greedy(400)))  # fmt: skip
            first = await call.read()
            await stub.Abort(pb.AbortRequest(request_id="to-abort"))
            rest = []
            while (r := await call.read()) is not grpc.aio.EOF:
                rest.append(r)
            try:
                await stub.Abort(pb.AbortRequest(request_id="to-abort"))
                again = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                again = e.code()
            return [first, *rest], again

    with StepGate(h.engine.engine, permits=1):  # one token, then held: only the abort ends it
        responses, again = h.run(main())
    assert responses[-1].finish_reason == "abort" and responses[-1].HasField("usage")
    assert responses[-1].usage.completion_tokens == 1
    assert again == grpc.StatusCode.NOT_FOUND
    wait_for(lambda: _free_blocks(h) == before and h.engine.num_in_flight == 0, "blocks freed")


BAD = [
    ("temperature", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1)),
     "sampling.temperature"),
    ("top_p", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0)), "sampling.top_p"),
    ("max_tokens", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=100_000)),
     "sampling.max_tokens"),
    ("logit_bias", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(logit_bias={1: 500})),
     "sampling.logit_bias"),
    ("stop_ids", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop_token_ids=[10**6])),
     "sampling.stop_token_ids"),
    ("no_prompt", pb.GenerateRequest(), "prompt"),
    ("empty_text", pb.GenerateRequest(text=""), "text"),
    ("token_range", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**6])), "token_ids.ids"),
    ("long_prompt", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 600)), "token_ids.ids"),
    ("empty_chat", pb.GenerateRequest(chat=pb.Chat()), "chat.messages"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "request_", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(served, case, request_, field) -> None:
    h, _ = served

    async def main() -> grpc.aio.AioRpcError:
        async with h.channel() as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(pb_grpc.ApplianceStub(ch), request_)
            return info.value

    err = h.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(f"{field}:"), err.details()
    assert field_violation(err) == field


def test_unknown_model_is_not_found_and_the_server_keeps_serving(served) -> None:
    h, _ = served

    async def main() -> tuple:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as gen_err:
                await _collect(stub, pb.GenerateRequest(model="gpt-9", text="hi"))
            with pytest.raises(grpc.aio.AioRpcError) as tok_err:
                await stub.Tokenize(pb.TokenizeRequest(model="gpt-9", text="hi"))
            ok = await _collect(stub, pb.GenerateRequest(model=h.engine.engine.model_name,
                                                         text="hi", sampling=_greedy(2)))  # fmt: skip
            return gen_err.value.code(), tok_err.value.code(), ok[-1].finish_reason

    assert h.run(main()) == (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.NOT_FOUND, "length")


def test_tokenize_detokenize_and_list_models(served) -> None:
    h, _ = served
    tok = h.engine.engine.tokenizer

    async def main() -> tuple:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            text = await stub.Tokenize(pb.TokenizeRequest(text=PROMPTS[0]))
            chat = await stub.Tokenize(pb.TokenizeRequest(
                chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in CHAT])))  # fmt: skip
            back = await stub.Detokenize(pb.DetokenizeRequest(token_ids=text.token_ids))
            models = await stub.ListModels(pb.ListModelsRequest())
            return text, chat, back, models

    text, chat, back, models = h.run(main())
    assert list(text.token_ids) == tok.encode(PROMPTS[0]) and text.count == len(text.token_ids)
    assert list(chat.token_ids) == tok.apply_chat_template(CHAT)
    assert back.text == tok.decode(tok.encode(PROMPTS[0]))
    assert [(m.id, m.max_model_len) for m in models.models] == [
        (h.engine.engine.model_name, h.engine.engine.max_model_len)
    ]


def test_health_serves_and_reflection_lists_and_describes_every_service(served) -> None:
    h, _ = served

    async def main() -> tuple:
        async with h.channel() as ch:
            health = health_pb2_grpc.HealthStub(ch)
            statuses = [
                (await health.Check(health_pb2.HealthCheckRequest(service=s))).status
                for s in ("", "appliance.v1.Appliance", "inference.GRPCInferenceService")
            ]
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            reqs = [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="appliance.v1.Appliance"),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService"),
            ]  # fmt: skip
            answers = [a async for a in refl.ServerReflectionInfo(iter(reqs))]
            return statuses, answers

    statuses, (listed, native, kserve) = h.run(main())
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 3
    names = {s.name for s in listed.list_services_response.service}
    assert {"appliance.v1.Appliance", "inference.GRPCInferenceService",
            "grpc.health.v1.Health"} <= names  # fmt: skip
    from google.protobuf import descriptor_pb2

    for answer, service in ((native, "Appliance"), (kserve, "GRPCInferenceService")):
        protos = answer.file_descriptor_response.file_descriptor_proto
        fdp = descriptor_pb2.FileDescriptorProto.FromString(protos[0])
        assert service in [s.name for s in fdp.service]
