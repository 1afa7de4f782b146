"""Structured outputs and tool calls against a real `appliance serve` process on the tiny
checkpoint, with the clients users run: the official openai SDK (`parse` with a Pydantic
model, a strict `json_schema`, a full tool loop streamed and not) and a gRPC stub (the
native `structured_outputs` oneof). The tiny model is random, so what is pinned is what the
grammar guarantees: every output that finished with "stop" validates (jsonschema), and a
forced tool call always parses, with arguments that validate against the function schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from tests.support.schemas import ORDER, PERSON
from tests.support.served_stack import ServeProcess, spawn_serve, tiny_serve_sets
from tests.support.waiting import HANG_S

# The tools section the fallback prompt writes into the system message is ~650 tokens of the
# tiny byte-level tokenizer: a tiny checkpoint with longer positions than the default 512.
MAX_MODEL_LEN = 1024
MAX_TOKENS = 200  # prompt + MAX_TOKENS stays within MAX_MODEL_LEN for every request here
SEEDS = range(8)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
     "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
     "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
                    "required": ["city"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class City(BaseModel):
    name: Literal["Paris", "Lyon", "Nice"]
    population: int = Field(ge=0, le=10_000_000)
    capital: bool


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[ServeProcess]:
    model_dir = tiny_checkpoint("llama", max_position_embeddings=MAX_MODEL_LEN)
    sp = spawn_serve(
        ["serve", *tiny_serve_sets(model_dir, **{"model.max_model_len": MAX_MODEL_LEN})]
    )
    try:
        yield sp
    finally:
        sp.kill()


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HANG_S
    )


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_sdk_parse_gives_pydantic_objects_whenever_it_stops(client: openai.OpenAI) -> None:
    parsed = 0
    for seed in SEEDS:
        try:
            r = client.chat.completions.parse(
                model="tiny", messages=_ask("A city?"), response_format=City,
                max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
            )  # fmt: skip
        except openai.LengthFinishReasonError:  # cut by max_tokens: a prefix, not an object
            continue
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, City)
        jsonschema.validate(json.loads(choice.message.content), City.model_json_schema())
        parsed += 1
    assert parsed > 0


@pytest.mark.parametrize("schema", [PERSON, ORDER], ids=["person", "order"])
def test_strict_json_schema_outputs_that_stop_validate(client: openai.OpenAI, schema) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": schema["title"], "schema": schema,
                                                  "strict": True}}  # fmt: skip
    r = client.chat.completions.create(
        model="tiny", messages=_ask("Fill the form."), response_format=fmt,
        max_tokens=MAX_TOKENS, temperature=1.0, seed=1, n=4,
    )  # fmt: skip
    reasons = [c.finish_reason for c in r.choices]
    assert set(reasons) <= {"stop", "length"} and "stop" in reasons
    for c in r.choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), schema)


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _tool_turn(client: openai.OpenAI, messages: list[dict], seed: int, stream: bool) -> dict:
    """One forced-call turn; the assistant message as a client sends it back."""
    kw = dict(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
    )  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        return choice.message.model_dump(exclude_none=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for tc in delta.tool_calls or []:
            acc = calls.setdefault(tc.index, {"id": "", "type": "function",
                                              "function": {"name": "", "arguments": ""}})  # fmt: skip
            acc["id"] += tc.id or ""
            if tc.function:
                acc["function"]["name"] += tc.function.name or ""
                acc["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    return {"role": "assistant", "tool_calls": [calls[0]]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_loop_always_parses_then_answers(client: openai.OpenAI, stream) -> None:
    for seed in range(4):
        messages = _ask("Weather in Paris for 3 days?")
        assistant = _tool_turn(client, messages, seed, stream)
        (call,) = assistant["tool_calls"]
        assert call["id"].startswith("call_")
        _check_call(call["function"]["name"], call["function"]["arguments"])
        messages += [assistant, {"role": "tool", "tool_call_id": call["id"], "content": "22 C"}]
        r = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=8, seed=seed
        )
        assert r.choices[0].finish_reason in ("stop", "length")
        assert isinstance(r.choices[0].message.content, str)


def test_grpc_native_json_schema_outputs_that_stop_validate(server: ServeProcess) -> None:
    request = pb.GenerateRequest(
        text="Fill the form:",
        sampling=pb.SamplingParams(
            json_schema=json.dumps(PERSON), n=4, max_tokens=MAX_TOKENS, temperature=1.0, seed=2
        ),
    )
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    with grpc.insecure_channel(server.grpc_address) as ch:
        for r in pb_grpc.ApplianceStub(ch).Generate(request, timeout=HANG_S):
            texts[r.index] = texts.get(r.index, "") + r.text
            if r.finish_reason:
                finish[r.index] = r.finish_reason
    assert sorted(finish) == [0, 1, 2, 3]
    assert set(finish.values()) <= {"stop", "length"} and "stop" in finish.values()
    for i, reason in finish.items():
        if reason == "stop":
            jsonschema.validate(json.loads(texts[i]), PERSON)
