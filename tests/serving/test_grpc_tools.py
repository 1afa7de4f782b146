"""Tool calls and reasoning on the native gRPC `Chat` prompt, through the generated stub: the
fake engine scripted to answer with chosen text for the loop (tools -> tool_calls -> tool
message -> answer), the streamed pieces' shape, a malformed call read as content, reasoning
split from content and the grammar a forced call puts on the engine request; the tiny real
engine for `required`, whose arguments must then validate against the function's schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import jsonschema

from appliance.grpc.native_chat import ChatParsers
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from tests.support.fake_engine import FakeLLMEngine
from tests.support.grpc_harness import start_harness
from tests.support.served_stack import tiny_engine

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = pb.Tool(name="get_weather", description="Weather in a city", parameters=json.dumps(SCHEMA))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USER = pb.ChatMessage(role="user", content="Weather in Paris?")


def _chat(messages: list[pb.ChatMessage], **kw: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.Chat(messages=messages, **kw), sampling=pb.SamplingParams(max_tokens=200)
    )


def run_fake(
    requests: list[pb.GenerateRequest], replies: list[str], parsers: ChatParsers | None = None
) -> tuple[list[Any], FakeLLMEngine]:
    """Each request's responses (or its AioRpcError), one after the other, on the fake."""
    fake = FakeLLMEngine()
    fake.replies = list(replies)
    h = start_harness(fake, chat_parsers=parsers or ChatParsers())

    async def main() -> list[Any]:
        out: list[Any] = []
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            for r in requests:
                try:
                    out.append([x async for x in stub.Generate(r)])
                except grpc.aio.AioRpcError as e:
                    out.append(e)
        return out

    try:
        return h.run(main()), fake
    finally:
        h.close()


def _prompt(fake: FakeLLMEngine, i: int) -> str:
    return fake.tokenizer.decode(fake.requests[i].ids)


def _calls(responses: list[pb.GenerateResponse]) -> list[pb.ToolCall]:
    """The calls the pieces add up to, as a client assembles them."""
    calls: dict[int, pb.ToolCall] = {}
    for r in responses:
        for d in r.tool_calls:
            c = calls.setdefault(d.index, pb.ToolCall(id=d.id, name=d.name))
            c.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def test_full_tool_loop_over_the_native_stub():
    first = _chat([USER], tools=[TOOL])
    (out,), _ = run_fake([first], [CALL])
    (call,) = _calls(out)
    assert call.id.startswith("call_") and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert out[-1].finish_reason == "tool_calls"
    assert "".join(r.content for r in out) == ""
    assert "".join(r.text for r in out) == CALL  # the raw text stays as the model wrote it
    history = [
        USER,
        pb.ChatMessage(role="assistant", tool_calls=[call]),
        pb.ChatMessage(role="tool", tool_call_id=call.id, content="22 C"),
    ]
    (a, b), fake = run_fake([first, _chat(history, tools=[TOOL])], [CALL, "It is 22 C."])
    assert "".join(r.content for r in b) == "It is 22 C." and not _calls(b)
    assert b[-1].finish_reason == "stop"
    # the fake's template has no tools section: the tools went into the system prompt
    assert _prompt(fake, 0).startswith("system: You can call the following tools")
    assert '"get_weather"' in _prompt(fake, 0)
    assert (
        'assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        in _prompt(fake, 1)
    )
    assert "user: <tool_response>\n22 C\n</tool_response>" in _prompt(fake, 1)


def test_streamed_call_pieces_carry_index_id_and_name_first_then_arguments():
    two = CALL + "\n" + CALL.replace("Paris", "Rome")
    (out,), _ = run_fake([_chat([USER], tools=[TOOL])], [two])
    pieces = [d for r in out for d in r.tool_calls]
    firsts = [d for d in pieces if d.id]
    assert [d.index for d in firsts] == [0, 1]
    assert all(d.name == "get_weather" for d in firsts)
    assert all(not d.name for d in pieces if not d.id)
    for i, d in enumerate(pieces):  # a call's id comes before any of its later pieces
        assert any(p.id and p.index == d.index for p in pieces[: i + 1])
    args = [json.loads(c.arguments) for c in _calls(out)]
    assert args == [{"city": "Paris"}, {"city": "Rome"}]


def test_malformed_call_is_returned_as_content():
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    (out,), _ = run_fake([_chat([USER], tools=[TOOL])], [bad])
    assert "".join(r.content for r in out) == bad and not _calls(out)
    assert out[-1].finish_reason == "stop"


def test_reasoning_split_from_content_and_enable_thinking_false():
    answer = "<think>Paris is in France.</think>\n\nParis."
    parsers = ChatParsers(reasoning_parser="qwen3")
    on, off = _chat([USER]), _chat([USER], enable_thinking=False)
    (a, b), _ = run_fake([on, off], [answer, answer], parsers)
    assert "".join(r.reasoning_content for r in a) == "Paris is in France."
    assert "".join(r.content for r in a) == "Paris."
    assert "".join(r.content for r in b) == answer
    assert not any(r.reasoning_content for r in b)


def test_forced_tool_choice_puts_the_grammar_on_the_engine_request():
    required = _chat([USER], tools=[TOOL], tool_choice=pb.ToolChoice(mode="required"))
    named = _chat([USER], tools=[TOOL], tool_choice=pb.ToolChoice(function="get_weather"))
    auto = _chat([USER], tools=[TOOL], tool_choice=pb.ToolChoice(mode="auto"))
    _, fake = run_fake([required, named, auto], [CALL, CALL, CALL])
    r, n, a = (x.params.structured_outputs for x in fake.requests)
    assert r.grammar.startswith('start: call ("\\n" call)*') and r.start_after is None
    assert n.grammar.startswith("start: call\n") and '"const": "get_weather"' in n.grammar
    assert a is None
    _, fake = run_fake([required], [CALL], ChatParsers(reasoning_parser="qwen3"))
    assert fake.requests[0].params.structured_outputs.start_after == "</think>"


def test_bad_tools_and_tool_choice_name_the_field():
    cases = [
        (_chat([USER], tools=[TOOL], tool_choice=pb.ToolChoice(function="nope")),
         "chat.tool_choice"),
        (_chat([USER], tools=[TOOL], tool_choice=pb.ToolChoice(mode="always")),
         "chat.tool_choice.mode"),
        (_chat([USER], tool_choice=pb.ToolChoice(mode="required")), "chat.tool_choice"),
        (_chat([USER], tools=[pb.Tool(name="f", parameters="{")]), "chat.tools.0.parameters"),
        (_chat([USER], tools=[pb.Tool(name="f", parameters="[]")]), "chat.tools.0.parameters"),
        (_chat([USER], tools=[pb.Tool(name="a b")]), "chat.tools.0.name"),
        (_chat([USER], tools=[pb.Tool(name="")]), "chat.tools.0.name"),
    ]  # fmt: skip
    outs, fake = run_fake([r for r, _ in cases], [])
    for (_, field), e in zip(cases, outs, strict=True):
        assert isinstance(e, grpc.aio.AioRpcError), field
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.details().startswith(f"{field}: "), e.details()
    assert not fake.requests
    (e,), _ = run_fake([_chat([USER], tools=[TOOL])], [], ChatParsers(tool_parser="none"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("chat.tools: ")


def test_required_on_the_tiny_engine_returns_arguments_that_follow_the_schema(
    tiny_llama_dir: Path,
):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
                       "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False,
    }  # fmt: skip
    tool = pb.Tool(name="forecast", parameters=json.dumps(schema))
    request = pb.GenerateRequest(
        chat=pb.Chat(
            messages=[USER], tools=[tool], tool_choice=pb.ToolChoice(mode="required"),
            parallel_tool_calls=False,
        ),
        sampling=pb.SamplingParams(max_tokens=96, temperature=1.0, seed=7),
    )  # fmt: skip
    h = start_harness(tiny_engine(tiny_llama_dir, max_model_len=512))

    async def main() -> list[pb.GenerateResponse]:
        async with h.channel() as ch:
            return [r async for r in pb_grpc.ApplianceStub(ch).Generate(request)]

    try:
        out = h.run(main())
    finally:
        h.close()
    assert out[-1].finish_reason == "tool_calls", "".join(r.text for r in out)
    (call,) = _calls(out)
    assert call.name == "forecast"
    jsonschema.validate(json.loads(call.arguments), schema)


def test_stop_strings_with_a_forced_call_are_refused_naming_sampling_stop():
    """Issue 28, E14: `stop: ['"', '{']` cut the forced call to `<tool_call>\\n`, "stop"."""
    req = _chat([USER], tools=[TOOL], tool_choice=pb.ToolChoice(mode="required"))
    req.sampling.stop.extend(['"', "{"])
    (e,), fake = run_fake([req], [CALL])
    assert isinstance(e, grpc.aio.AioRpcError), e
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith("sampling.stop: "), e.details()
    assert not fake.requests


def test_a_forced_call_cut_by_max_tokens_is_never_sent_and_is_logged(caplog):
    """Issue 28, E15. Before, a forced call's pieces went out as generated, so the call cut
    by max_tokens arrived with arguments `{"ci` (broken JSON) after the complete ones."""
    lyon = CALL.replace("Paris", "Lyon")
    cut_at = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    text = f'{CALL}\n{lyon}\n{cut_at}ty": "Nice"}}}}\n</tool_call>'
    req = _chat([USER], tools=[TOOL], tool_choice=pb.ToolChoice(mode="required"))
    req.sampling.max_tokens = len(f"{CALL}\n{lyon}\n{cut_at}")  # the fake: a character a token
    with caplog.at_level("WARNING", logger="appliance.grpc.native_chat"):
        (out,), _ = run_fake([req], [text])
    assert out[-1].finish_reason == "length"
    assert [json.loads(c.arguments) for c in _calls(out)] == [{"city": "Paris"}, {"city": "Lyon"}]
    assert any(r.getMessage() == "tool call cut short was dropped" for r in caplog.records)
