"""Structured outputs on the HTTP API: every spelling a client sends becomes the engine's
`SamplingParams.structured_outputs`, and every bad one a 400 naming the field it wrote.

The mapping runs in-process over a fake engine that records the params it receives; the
official openai SDK runs against a real server on the tiny checkpoint. Whether the output
obeys the constraint is the grammar engine's to prove: the test that needs the real mask
is skipped until `engine.worker.structured` exists.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from appliance.config import ServerConfig
from appliance.http.app import build_app
from appliance.http.server import BackgroundServer
from engine import SamplingParams, StructuredOutputsParams
from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParamsError
from tests.support.fake_engine import FakeLLMEngine
from tests.support.served_stack import tiny_engine
from tests.support.waiting import HANG_S

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
CMPL = {"prompt": "hi", "max_tokens": 3}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


class RecordingEngine(FakeLLMEngine):
    """The fake engine, keeping each request's SamplingParams; `refuse` makes admission
    raise, as the grammar engine does for a constraint that does not compile."""

    def __init__(self, refuse: SamplingParamsError | None = None):
        super().__init__()
        self.seen: list[SamplingParams] = []
        self.refuse = refuse

    def prepare_request(self, request_id, prompt, params, **kw):
        if self.refuse is not None:
            raise self.refuse
        self.seen.append(params)
        return super().prepare_request(request_id, prompt, params, **kw)


def _post(path: str, body: dict, refuse: SamplingParamsError | None = None):
    """(response, the params the engine received) for one request in-process."""

    async def go():
        fake = RecordingEngine(refuse)
        aeng = AsyncEngine(fake)
        app = build_app(aeng, ServerConfig())
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                r = await c.post(path, json=body)
        finally:
            await aeng.shutdown()
        return r, fake.seen

    return asyncio.run(asyncio.wait_for(go(), HANG_S))


def _so(**kw: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


# (id, extra body fields, the engine's structured_outputs)
MAPPED: list[tuple[str, dict[str, Any], StructuredOutputsParams | None]] = [
    ("no constraint", {}, None),
    ("response_format text", {"response_format": {"type": "text"}}, None),
    ("response_format json_object", {"response_format": {"type": "json_object"}}, _so(json_object=True)),
    ("response_format json_schema strict", {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}}, _so(json=SCHEMA)),
    ("response_format json_schema with description", {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "description": "a city", "schema": SCHEMA}}}, _so(json=SCHEMA)),
    ("structured_outputs json", {"structured_outputs": {"json": SCHEMA}}, _so(json=SCHEMA)),
    ("structured_outputs json as text", {"structured_outputs": {"json": json.dumps(SCHEMA)}}, _so(json=SCHEMA)),
    ("structured_outputs json_object", {"structured_outputs": {"json_object": True}}, _so(json_object=True)),
    ("structured_outputs regex", {"structured_outputs": {"regex": "[0-9]{3}"}}, _so(regex="[0-9]{3}")),
    ("structured_outputs choice", {"structured_outputs": {"choice": ["yes", "no"]}}, _so(choice=("yes", "no"))),
    ("structured_outputs grammar", {"structured_outputs": {"grammar": 'start: "a"+'}}, _so(grammar='start: "a"+')),
    ("guided_json", {"guided_json": SCHEMA}, _so(json=SCHEMA)),
    ("guided_regex", {"guided_regex": "a|b"}, _so(regex="a|b")),
    ("guided_choice", {"guided_choice": ["x", "y"]}, _so(choice=("x", "y"))),
    ("guided_grammar", {"guided_grammar": 'start: "z"'}, _so(grammar='start: "z"')),
]  # fmt: skip


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", CMPL)])
@pytest.mark.parametrize("extra, want", [m[1:] for m in MAPPED], ids=[m[0] for m in MAPPED])
def test_each_spelling_reaches_the_engine_as_one_constraint(path, base, extra, want) -> None:
    r, seen = _post(path, {**base, **extra})
    assert r.status_code == 200, r.text
    assert [p.structured_outputs for p in seen] == [want]


# (id, extra body fields, the param the 400 names)
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("unknown response_format type", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("response_format without type", {"response_format": {}}, "response_format.type"),
    ("json_schema without json_schema", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("json_schema without schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ("json_schema without name", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
    ("json_schema schema a list", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format.json_schema.schema"),
    ("json_schema unknown key", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "format": 1}}}, "response_format.json_schema.format"),
    ("structured_outputs empty", {"structured_outputs": {}}, "structured_outputs"),
    ("structured_outputs two kinds", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ("structured_outputs unknown key", {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ("structured_outputs a string", {"structured_outputs": "json"}, "structured_outputs"),
    ("structured_outputs json text not an object", {"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
    ("structured_outputs json text not json", {"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
    ("choice empty", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("choice empty string", {"guided_choice": ["a", ""]}, "guided_choice"),
    ("guided_choice empty", {"guided_choice": []}, "guided_choice"),
    ("guided_regex not a string", {"guided_regex": 5}, "guided_regex"),
    ("guided_regex empty", {"guided_regex": ""}, "guided_regex"),
    ("guided_grammar not a string", {"guided_grammar": ["start"]}, "guided_grammar"),
    ("guided_json a number", {"guided_json": 5}, "guided_json"),
    ("response_format and guided_regex", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("structured_outputs and guided_json", {"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json"),
    ("guided_decoding_backend", {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
]  # fmt: skip


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", CMPL)])
@pytest.mark.parametrize("extra, param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_constraint_is_a_400_naming_the_field(path, base, extra, param) -> None:
    r, seen = _post(path, {**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["type"]) == (param, "invalid_request_error"), err
    assert seen == []


def test_more_than_one_constraint_names_every_field_it_got() -> None:
    body = {**CHAT, "response_format": {"type": "json_object"}, "guided_choice": ["a"]}
    r, _ = _post("/v1/chat/completions", body)
    message = r.json()["error"]["message"]
    assert "response_format" in message and "guided_choice" in message


# (the field the client used, the engine's error param) -> the 400 names the client's field
ENGINE_REFUSED = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "structured_outputs.json", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}}, "structured_outputs.json_object", "response_format"),
    ({"guided_regex": "(unclosed"}, "structured_outputs.regex", "guided_regex"),
    ({"structured_outputs": {"grammar": "start: ???"}}, "structured_outputs.grammar", "structured_outputs.grammar"),
    ({"guided_choice": ["a"]}, "structured_outputs", "guided_choice"),
]  # fmt: skip


@pytest.mark.parametrize("extra, engine_param, param", ENGINE_REFUSED)
def test_a_constraint_the_grammar_engine_refuses_is_a_400_naming_the_clients_field(
    extra, engine_param, param
) -> None:
    refuse = SamplingParamsError("does not compile: unexpected token", engine_param)
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", CMPL)):
        r, _ = _post(path, {**base, **extra}, refuse)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param
        assert err["message"] == f"{param}: does not compile: unexpected token"


def test_the_offline_api_exports_the_constraint_types() -> None:
    import engine

    params = engine.SamplingParams(
        structured_outputs=engine.StructuredOutputsParams(choice=["red", "blue"])
    )
    assert params.structured_outputs is not None
    assert params.structured_outputs.kind == "choice"
    assert params.structured_outputs.choice == ("red", "blue")
    assert {"SamplingParams", "StructuredOutputsParams"} <= set(engine.__all__)


def test_the_openapi_document_describes_every_spelling() -> None:
    r = asyncio.run(_get_openapi())
    props = r["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"response_format", "structured_outputs", "guided_json", "guided_regex",
            "guided_choice", "guided_grammar"} <= set(props)  # fmt: skip


async def _get_openapi() -> dict:
    aeng = AsyncEngine(FakeLLMEngine())
    try:
        transport = httpx.ASGITransport(app=build_app(aeng, ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return (await c.get("/openapi.json")).json()
    finally:
        await aeng.shutdown()


# ---- the official openai SDK against a real server ---------------------------------------
class City(BaseModel):
    city: str
    population: int


@pytest.fixture(scope="module")
def client(tiny_llama_dir) -> Iterator[openai.OpenAI]:
    aeng = AsyncEngine(tiny_engine(tiny_llama_dir))
    with BackgroundServer(build_app(aeng, ServerConfig())) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    asyncio.run(aeng.shutdown())


def test_sdk_json_schema_strict_and_guided_extras_are_accepted(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a city."}]
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=4,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
        },
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(
        model="tiny", prompt="Yes or no?", max_tokens=2, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=messages, response_format={"type": "yaml"}
        )
    assert e.value.body["param"] == "response_format.type"


def test_sdk_parse_returns_an_object_of_the_pydantic_model(client: openai.OpenAI) -> None:
    parsed = []
    for seed in range(5):
        try:
            r = client.chat.completions.parse(
                model="tiny",
                messages=[{"role": "user", "content": "Name a city and its population."}],
                response_format=City,
                max_tokens=90,  # the test server's context is 128 tokens
                temperature=1.0,
                seed=seed,
            )
        except openai.LengthFinishReasonError:  # cut by max_tokens: a prefix, not an object
            continue
        parsed.append(r.choices[0].message.parsed)
    assert parsed and all(isinstance(p, City) for p in parsed)


def test_constraints_that_leave_no_token_are_a_400_and_the_server_keeps_serving(
    client: openai.OpenAI,
) -> None:
    """A grammar that allows only EOS while min_tokens masks EOS is found only while
    generating; it is the request's own doing, so a 400 naming the masks (not a 500), and
    the next request is served."""
    conflict = {"guided_choice": ["yes"], "min_tokens": 20}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Yes?", max_tokens=30, extra_body=conflict)
    assert e.value.body["type"] == "invalid_request_error"
    assert "min_tokens=20" in e.value.body["message"]
    r = client.completions.create(
        model="tiny", prompt="Yes?", max_tokens=2, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert r.choices[0].finish_reason in ("stop", "length")
