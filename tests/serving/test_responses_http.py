"""/v1/responses with the official openai SDK on the fake engine scripted to answer with
chosen text: the object's shape, streaming (the SDK's `responses.stream()` assembles the
same object as the non-streamed call, field by field), function tools with
`function_call_output` items, reasoning items, `text.format` parsed into a pydantic model,
incomplete and failed responses, retrieval, deletion, input items and ownership by key."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

from appliance.config import ServerConfig
from appliance.responses.store import ResponseStore
from tests.support.fake_openai import prompt_text, run_with_fake

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False}, "strict": True},
]  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
KEYS = ("key-a", "key-b")


def run(fn, replies: list[str], server: ServerConfig | None = None, store=None):
    return run_with_fake(fn, replies, server, responses_store=store)


_prompt = prompt_text


def _normalized(obj: dict) -> dict:
    """A response with what differs between two runs (ids, times) replaced by placeholders,
    and without what the SDK's stream helper adds on its side (`parsed`, `parsed_arguments`)."""
    out = json.loads(json.dumps(obj))
    out["id"] = "RESP"
    out["created_at"] = out["completed_at"] = 0
    for i, item in enumerate(out["output"]):
        item["id"] = f"ITEM{i}"
        if "call_id" in item:
            item["call_id"] = f"CALL{i}"
        item.pop("parsed_arguments", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return out


def whole_output(r) -> list[dict]:
    """The output items as sent (the stream helper's own `parsed` fields left out)."""
    items = [i.model_dump(mode="json") for i in r.output]
    for item in items:
        item.pop("parsed_arguments", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return items


async def _stream_events(client, **kw) -> tuple[list, object]:
    async with client.responses.stream(**kw) as s:
        events = [ev async for ev in s]
        final = await s.get_final_response()
    return events, final


def test_create_answers_a_completed_response_in_openai_shape():
    async def fn(client, fake):
        r = await client.responses.create(
            model="fake-model", input="Hi", instructions="Be brief.", max_output_tokens=50,
            metadata={"k": "v"}, user="u1",
        )  # fmt: skip
        assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
        assert r.model == "fake-model" and r.error is None and r.incomplete_details is None
        (msg,) = r.output
        assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
        assert msg.id.startswith("msg_") and [c.type for c in msg.content] == ["output_text"]
        assert r.output_text == "Hello there."
        assert _prompt(fake, 0) == "system: Be brief.\nuser: Hi\nassistant: "
        prompt_len = len(fake.requests[0].ids)
        assert r.usage.input_tokens == prompt_len and r.usage.output_tokens == 12
        assert r.usage.total_tokens == prompt_len + 12
        assert r.usage.input_tokens_details.cached_tokens == 0
        assert r.usage.output_tokens_details.reasoning_tokens == 0
        assert r.metadata == {"k": "v"} and r.user == "u1" and r.max_output_tokens == 50
        assert r.instructions == "Be brief." and r.text.format.type == "text"

    run(fn, ["Hello there."])


def test_stream_assembles_the_same_object_as_create_field_by_field():
    async def fn(client, fake):
        kw = dict(model="fake-model", input="Weather?", tools=TOOLS, max_output_tokens=200)
        whole = await client.responses.create(**kw)
        events, final = await _stream_events(client, **kw)
        assert _normalized(final.model_dump(mode="json")) == _normalized(
            whole.model_dump(mode="json")
        )
        assert [e.sequence_number for e in events] == list(range(len(events)))
        types = [e.type for e in events]
        assert types[:2] == ["response.created", "response.in_progress"]
        assert types[-1] == "response.completed"
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        # the items built from the events are those of the final response
        done = [
            e.item.model_dump(mode="json") for e in events if e.type == "response.output_item.done"
        ]
        assert done == whole_output(final)
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == final.output[0].content[0].text == "Let me check.\n"
        args = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert json.loads(args) == json.loads(args_done.arguments) == {"city": "Paris"}
        assert types == [
            "response.created", "response.in_progress",
            "response.output_item.added", "response.content_part.added",
            *["response.output_text.delta"] * types.count("response.output_text.delta"),
            "response.output_text.done", "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            *["response.function_call_arguments.delta"]
            * types.count("response.function_call_arguments.delta"),
            "response.function_call_arguments.done", "response.output_item.done",
            "response.completed",
        ]  # fmt: skip
        # the stored copy is the streamed final object, exactly
        stored = await client.responses.retrieve(final.id)
        assert stored.output == final.output or whole_output(stored) == whole_output(final)
        assert stored.usage == final.usage and stored.id == final.id

    reply = "Let me check.\n" + CALL
    run(fn, [reply, reply])


def test_function_tool_round_trip_with_function_call_output_items():
    async def fn(client, fake):
        items = [{"role": "user", "content": "Weather in Paris?"}]
        r = await client.responses.create(model="fake-model", input=items, tools=TOOLS,
                                          store=False)  # fmt: skip
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.call_id.startswith("call_") and call.status == "completed"
        assert json.loads(call.arguments) == {"city": "Paris"}
        assert _prompt(fake, 0).startswith("system: You can call the following tools")
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "22 C"})
        r2 = await client.responses.create(model="fake-model", input=items, tools=TOOLS,
                                           store=False)  # fmt: skip
        assert r2.output_text == "It is 22 C." and r2.status == "completed"
        history = _prompt(fake, 1)
        assert (
            'assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            in history
        )
        assert history.endswith("user: <tool_response>\n22 C\n</tool_response>\nassistant: ")
        # store: false kept nothing
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(r.id)

    run(fn, [CALL, "It is 22 C."])


def test_required_tool_choice_is_a_grammar_on_the_engine_request():
    async def fn(client, fake):
        await client.responses.create(
            model="fake-model", input="x", tools=TOOLS, tool_choice="required"
        )
        await client.responses.create(
            model="fake-model", input="x", tools=TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
        )  # fmt: skip
        required, named = (r.params.structured_outputs for r in fake.requests)
        assert required.grammar.startswith('start: call ("\\n" call)*')
        assert (
            named.grammar.startswith("start: call\n") and '"const": "get_weather"' in named.grammar
        )

    run(fn, [CALL, CALL])


class Weather(pydantic.BaseModel):
    city: str
    celsius: int


def test_parse_reads_json_schema_output_into_a_pydantic_model():
    async def fn(client, fake):
        r = await client.responses.parse(model="fake-model", input="weather", text_format=Weather)
        assert r.output_parsed == Weather(city="Paris", celsius=22)
        so = fake.requests[0].params.structured_outputs
        assert so.json["properties"]["celsius"] == {"title": "Celsius", "type": "integer"}
        assert r.text.format.type == "json_schema" and r.text.format.name == "Weather"

    run(fn, ['{"city": "Paris", "celsius": 22}'])


def test_reasoning_becomes_a_reasoning_item_with_its_token_count():
    server = ServerConfig(reasoning_parser="qwen3")

    async def fn(client, fake):
        kw = dict(model="fake-model", input="2+2?", include=["reasoning.encrypted_content"])
        r = await client.responses.create(**kw)
        rs, msg = r.output
        assert rs.type == "reasoning" and rs.id.startswith("rs_")
        assert [c.text for c in rs.content] == ["add them"] and rs.summary == []
        assert msg.content[0].text == "4"
        # the fake tokenizer has a token per character: "<think>add them</think>" is 23
        assert r.usage.output_tokens_details.reasoning_tokens == 23
        events, final = await _stream_events(client, **kw)
        assert _normalized(final.model_dump(mode="json")) == _normalized(r.model_dump(mode="json"))
        kinds = [e.type for e in events if "reasoning" in e.type]
        assert kinds[0] == "response.reasoning_text.delta"
        assert kinds[-1] == "response.reasoning_text.done"
        # the encoded reasoning, sent back without a store, is read as the assistant's
        back = [{"role": "user", "content": "2+2?"},
                {"type": "reasoning", "summary": [], "encrypted_content": rs.encrypted_content},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]  # fmt: skip
        r3 = await client.responses.create(model="fake-model", input=back, store=False)
        assert r3.output_text == "6" and _prompt(fake, 2).endswith("user: and 3+3?\nassistant: ")

    reply = "<think>add them</think>4"
    run(fn, [reply, reply, "6"], server)


def test_max_output_tokens_makes_an_incomplete_response():
    async def fn(client, fake):
        r = await client.responses.create(model="fake-model", input="Hi", max_output_tokens=5)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].status == "incomplete" and r.output_text == "Hello"
        stream = await client.responses.create(
            model="fake-model", input="Hi", max_output_tokens=5, stream=True
        )
        events = [e async for e in stream]
        assert events[-1].type == "response.incomplete"
        final = events[-1].response
        assert _normalized(final.model_dump(mode="json")) == _normalized(r.model_dump(mode="json"))

    run(fn, ["Hello there.", "Hello there."])


def test_an_engine_failure_is_a_500_and_a_failed_stream():
    async def fn(client, fake):
        fake.fail_steps = 1
        with pytest.raises(openai.InternalServerError):
            await client.responses.create(model="fake-model", input="Hi")
        fake.fail_steps = 1
        stream = await client.responses.create(model="fake-model", input="Hi", stream=True)
        events = [e async for e in stream]
        assert events[-1].type == "response.failed"
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "server_error"
        assert "injected step failure" in failed.error.message
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(
                model="fake-model", input="again", previous_response_id=failed.id
            )
        assert e.value.body["param"] == "previous_response_id"

    run(fn, [])


def test_previous_response_id_prepends_the_stored_conversation():
    async def fn(client, fake):
        r1 = await client.responses.create(model="fake-model", input="Hi", instructions="A")
        r2 = await client.responses.create(
            model="fake-model", input="More", previous_response_id=r1.id, instructions="B"
        )
        assert _prompt(fake, 1) == (
            "system: B\nuser: Hi\nassistant: Hello.\nuser: More\nassistant: "
        )  # instructions are not carried over
        assert r2.previous_response_id == r1.id
        page = await client.responses.input_items.list(r2.id, order="asc")
        assert [(i.type, getattr(i, "role", None)) for i in page.data] == [
            ("message", "user"),
            ("message", "assistant"),
            ("message", "user"),
        ]
        assert page.data[1].id == r1.output[0].id and not page.has_more
        newest = await client.responses.input_items.list(r2.id, limit=1)
        assert newest.data[0].content[0].text == "More" and newest.has_more
        rest = await client.responses.input_items.list(r2.id, limit=5, after=newest.last_id)
        assert [i.id for i in rest.data] == [i.id for i in page.data[:2]][::-1]

    run(fn, ["Hello.", "Again."])


def test_retrieve_delete_and_another_key_gets_404():
    server = ServerConfig(api_keys=KEYS)

    async def fn(client, fake):
        a, b = client.with_options(api_key="key-a"), client.with_options(api_key="key-b")
        r = await a.responses.create(model="fake-model", input="Hi")
        assert (await a.responses.retrieve(r.id)).output_text == "Hello."
        for call in (
            b.responses.retrieve(r.id),
            b.responses.delete(r.id),
            b.responses.input_items.list(r.id),
            b.responses.create(model="fake-model", input="x", previous_response_id=r.id),
        ):
            with pytest.raises(openai.NotFoundError):
                await call
        await a.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError) as e:
            await a.responses.retrieve(r.id)
        assert e.value.body["code"] == "not_found"
        with pytest.raises(openai.NotFoundError):
            await a.responses.delete(r.id)

    run(fn, ["Hello."], server)


def test_a_store_file_survives_a_restart(tmp_path):
    path = tmp_path / "responses.sqlite3"

    async def create(client, fake):
        return (await client.responses.create(model="fake-model", input="Hi")).id

    rid = run(create, ["Hello."], store=ResponseStore(path, 10, None))

    async def read(client, fake):
        return await client.responses.retrieve(rid)

    assert run(read, [], store=ResponseStore(path, 10, None)).output_text == "Hello."


def test_input_tokens_counts_the_rendered_prompt():
    async def fn(client, fake):
        n = await client.responses.input_tokens.count(model="fake-model", input="Hi")
        assert n.input_tokens == len("user: Hi\nassistant: ")
        assert not fake.requests

    run(fn, [])


def test_reasoning_effort_none_turns_thinking_off():
    server = ServerConfig(reasoning_parser="qwen3")

    async def fn(client, fake):
        r = await client.responses.create(
            model="fake-model", input="2+2?", reasoning={"effort": "none"}
        )
        assert [i.type for i in r.output] == ["message"]
        assert r.output_text == "<think>x</think>4" and r.reasoning.effort == "none"
        assert r.usage.output_tokens_details.reasoning_tokens == 0

    run(fn, ["<think>x</think>4"], server)


def test_a_call_cut_by_max_output_tokens_is_left_out_and_the_complete_ones_stand():
    """Issue 28, E15. Before, under `auto` the cut third call turned the whole answer into
    one message of raw `<tool_call>` markup; with `required` the cut call came out as a
    function_call item whose arguments were broken JSON."""
    lyon = CALL.replace("Paris", "Lyon")
    cut_at = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    text = f'{CALL}\n{lyon}\n{cut_at}ty": "Nice"}}}}\n</tool_call>'
    limit = len(f"{CALL}\n{lyon}\n{cut_at}")  # the fake engine: one character a token

    async def fn(client, fake):
        for choice in ("auto", "required"):
            r = await client.responses.create(
                model="fake-model", input="Weather?", tools=TOOLS, tool_choice=choice,
                max_output_tokens=limit, store=False,
            )  # fmt: skip
            assert r.status == "incomplete", choice
            assert [o.type for o in r.output] == ["function_call"] * 2, (choice, r.output)
            assert [json.loads(o.arguments) for o in r.output] == [
                {"city": "Paris"}, {"city": "Lyon"}]  # fmt: skip
            assert all(o.status == "completed" for o in r.output), choice

    run(fn, [text, text])
