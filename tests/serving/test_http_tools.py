"""Tool calls and reasoning through /v1/chat/completions with the official openai SDK, on
the fake engine scripted to answer with chosen text: the full loop (tools -> tool_calls ->
tool message -> answer), streamed and not, the constraint a forced call puts on the engine
request, reasoning split from content."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from appliance.config import ServerConfig
from tests.support.fake_openai import prompt_text, run_with_fake

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}}},
]  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def run(fn, replies: list[str], server: ServerConfig | None = None):
    return run_with_fake(fn, replies, server)


_prompt = prompt_text


def test_full_tool_loop_non_streamed():
    async def fn(client, fake):
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        r = await client.chat.completions.create(
            model="fake-model", messages=msgs, tools=TOOLS, max_tokens=200
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        # the fake's template has no tools section: the tools went into the system prompt
        assert _prompt(fake, 0).startswith("system: You can call the following tools")
        assert '"get_weather"' in _prompt(fake, 0)
        msgs += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "22 C"}]  # fmt: skip
        r2 = await client.chat.completions.create(
            model="fake-model", messages=msgs, tools=TOOLS, max_tokens=200
        )
        assert r2.choices[0].message.content == "It is 22 C."
        assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
        history = _prompt(fake, 1)
        assert (
            'assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            in history
        )
        assert "user: <tool_response>\n22 C\n</tool_response>" in history

    run(fn, [CALL, "It is 22 C."])


def test_full_tool_loop_streamed_in_openai_shape():
    async def fn(client, fake):
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        stream = await client.chat.completions.create(
            model="fake-model", messages=msgs, tools=TOOLS, max_tokens=200, stream=True
        )
        chunks = [c async for c in stream]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [t for d in deltas for t in d.tool_calls or []]
        assert calls[0].index == 0 and calls[0].id.startswith("call_")
        assert calls[0].type == "function" and calls[0].function.name == "get_weather"
        assert all(t.id is None and t.function.name is None for t in calls[1:])
        args = "".join(t.function.arguments or "" for t in calls)
        assert json.loads(args) == {"city": "Paris"}
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert [r for r in reasons if r] == ["tool_calls"]
        assert not any(d.content for d in deltas)
        msgs += [
            {"role": "assistant", "tool_calls": [{"id": calls[0].id, "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "22 C"},
        ]  # fmt: skip
        stream = await client.chat.completions.create(
            model="fake-model", messages=msgs, tools=TOOLS, max_tokens=200, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "It is 22 C."

    run(fn, [CALL, "It is 22 C."])


def test_malformed_call_under_auto_is_content():
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'

    async def fn(client, fake):
        r = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "x"}], tools=TOOLS,
            max_tokens=200,
        )  # fmt: skip
        assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"

    run(fn, [bad])


def test_forced_tool_choice_constrains_the_engine_request():
    async def fn(client, fake):
        msgs = [{"role": "user", "content": "x"}]
        await client.chat.completions.create(
            model="fake-model", messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=200
        )
        await client.chat.completions.create(
            model="fake-model", messages=msgs, tools=TOOLS, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        await client.chat.completions.create(
            model="fake-model", messages=msgs, tools=TOOLS, tool_choice="auto", max_tokens=200
        )
        required, named, auto = (r.params.structured_outputs for r in fake.requests)
        assert required.grammar.startswith('start: call ("\\n" call)*')
        assert named.grammar.startswith("start: call\n")
        assert '"const": "get_weather"' in named.grammar and auto is None
        with_reasoning = chat_params_with_reasoning()
        assert with_reasoning == "</think>"
        try:
            await client.chat.completions.create(
                model="fake-model", messages=msgs, tools=TOOLS, max_tokens=5,
                tool_choice={"type": "function", "function": {"name": "nope"}},
            )  # fmt: skip
            raise AssertionError("a 400 was expected")
        except openai.BadRequestError as e:
            assert e.body["param"] == "tool_choice"

    run(fn, [CALL, CALL, CALL])


def chat_params_with_reasoning() -> str | None:
    from appliance.dialect.chat_output import chat_dialect

    d = chat_dialect(TOOLS, "required", None, "hermes", "qwen3", None)
    return d.constraint().start_after


def test_reasoning_content_split_streamed_and_not():
    server = ServerConfig(reasoning_parser="qwen3")
    answer = "<think>Paris is in France.</think>\n\nParis."

    async def fn(client, fake):
        msgs = [{"role": "user", "content": "Capital?"}]
        r = await client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=99)
        m = r.choices[0].message
        assert (m.reasoning_content, m.content) == ("Paris is in France.", "Paris.")
        stream = await client.chat.completions.create(
            model="fake-model", messages=msgs, max_tokens=99, stream=True
        )
        deltas = [c.choices[0].delta async for c in stream if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        assert reasoning == "Paris is in France."
        assert "".join(d.content or "" for d in deltas) == "Paris."
        r = await client.chat.completions.create(
            model="fake-model", messages=msgs, max_tokens=99,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )  # fmt: skip
        assert r.choices[0].message.content == answer
        assert getattr(r.choices[0].message, "reasoning_content", None) is None

    run(fn, [answer, answer, answer], server)


def test_tools_refused_when_the_server_parses_none():
    async def fn(client, fake):
        try:
            await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "x"}], tools=TOOLS
            )
            raise AssertionError("a 400 was expected")
        except openai.BadRequestError as e:
            assert e.body["param"] == "tools"

    run(fn, [], ServerConfig(tool_parser="none"))


# ---- issue 28, E15: a tool-call answer cut by max_tokens ------------------------------------
CALL_LYON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
CUT_AT = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
THREE_CALLS = f'{CALL}\n{CALL_LYON}\n{CUT_AT}ty": "Nice"}}}}\n</tool_call>'
CUT_TOKENS = len(f"{CALL}\n{CALL_LYON}\n{CUT_AT}")  # the fake engine: one character a token


def _cut_request(client, tool_choice: str, stream: bool = False):
    return client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        tool_choice=tool_choice, max_tokens=CUT_TOKENS, stream=stream,
    )  # fmt: skip


def test_a_length_finish_returns_the_complete_calls_and_drops_the_cut_one():
    """Before: the cut third call made the whole answer "malformed", so both complete calls
    came back as raw `<tool_call>` markup in content, with no tool_calls."""

    async def fn(client, fake):
        for choice_kind in ("required", "auto"):
            r = await _cut_request(client, choice_kind)
            choice = r.choices[0]
            assert choice.finish_reason == "length", choice_kind
            assert choice.message.content is None, (choice_kind, choice.message.content)
            args = [json.loads(c.function.arguments) for c in choice.message.tool_calls]
            assert args == [{"city": "Paris"}, {"city": "Lyon"}], choice_kind

    run(fn, [THREE_CALLS, THREE_CALLS])


def test_a_streamed_auto_answer_cut_by_length_sends_the_complete_calls():
    async def fn(client, fake):
        calls: dict[int, dict] = {}
        content, reasons = "", []
        async for chunk in await _cut_request(client, "auto", stream=True):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                reasons.append(ch.finish_reason)
                for t in ch.delta.tool_calls or ():
                    c = calls.setdefault(t.index, {"name": "", "arguments": ""})
                    c["name"] += t.function.name or ""
                    c["arguments"] += t.function.arguments or ""
        assert "<tool_call>" not in content and reasons[-1] == "length", (content, reasons)
        assert [json.loads(c["arguments"]) for c in calls.values()] == [
            {"city": "Paris"},
            {"city": "Lyon"},
        ]

    run(fn, [THREE_CALLS])


def test_a_call_cut_before_any_completed_is_no_markup_in_content():
    async def fn(client, fake):
        r = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "x"}], tools=TOOLS,
            tool_choice="required", max_tokens=len(CUT_AT),
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "length" and not choice.message.tool_calls
        assert not choice.message.content, choice.message.content

    run(fn, [THREE_CALLS])


def test_parallel_tool_calls_false_forces_exactly_one_call():
    async def fn(client, fake):
        await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "x"}], tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False, max_tokens=200,
        )  # fmt: skip
        grammar = fake.requests[0].params.structured_outputs.grammar
        assert grammar.startswith("start: call\n"), grammar

    run(fn, [CALL])


def test_stop_strings_with_a_forced_call_are_a_400_naming_stop():
    """Issue 28, E14: before, `stop: ['"', '{']` ended the forced call as content
    `<tool_call>\\n` with finish "stop"; under `auto` stop strings still apply."""

    async def fn(client, fake):
        msgs = [{"role": "user", "content": "x"}]
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            try:
                await client.chat.completions.create(
                    model="fake-model", messages=msgs, tools=TOOLS, tool_choice=choice,
                    stop=['"', "{"], max_tokens=200,
                )  # fmt: skip
                raise AssertionError("a 400 was expected")
            except openai.BadRequestError as e:
                assert e.body["param"] == "stop", e.body
        assert not fake.requests
        r = await client.chat.completions.create(
            model="fake-model", messages=msgs, tools=TOOLS, stop=["Paris"], max_tokens=200
        )
        assert r.choices[0].finish_reason in ("stop", "tool_calls")

    run(fn, ["plain answer"])


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_a_streamed_answer_cut_by_length_never_sends_the_cut_call(tool_choice):
    """The openai SDK's stream helper assembles the call deltas and hands out each call's
    arguments (`tool_calls.function.arguments.done`) when the next call or the finish comes.
    Before, a forced call was sent as it came, so the cut third call arrived as `{"ci` and
    the helper handed it out as a call whose arguments are broken JSON (json.loads raised
    here); and under `auto` the held calls came in the finish chunk, which the helper reads
    before the calls, so the last complete call was never handed out."""

    async def fn(client, fake):
        done_args = []
        async with client.chat.completions.stream(
            model="fake-model", messages=[{"role": "user", "content": "Weather?"}],
            tools=TOOLS, tool_choice=tool_choice, max_tokens=CUT_TOKENS,
        ) as stream:  # fmt: skip
            async for event in stream:
                if event.type == "tool_calls.function.arguments.done":
                    done_args.append(json.loads(event.arguments))
            # get_final_completion() raises LengthFinishReasonError at any "length" finish
            choice = stream.current_completion_snapshot.choices[0]
        assert choice.finish_reason == "length" and not choice.message.content
        assert done_args == [{"city": "Paris"}, {"city": "Lyon"}], done_args
        assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == done_args

    run(fn, [THREE_CALLS])


def test_dropped_cut_calls_are_counted_in_the_metrics():
    """Before, a dropped call was only logged: no series counted it."""

    async def fn(client, fake):
        await _cut_request(client, "auto")
        async for _ in await _cut_request(client, "required", stream=True):
            pass
        r = await client.with_options(base_url="http://t").get("/metrics", cast_to=httpx.Response)
        return r.text

    text = run(fn, [THREE_CALLS, THREE_CALLS])
    assert 'appliance_tool_calls_dropped_total{finish_reason="length"} 2.0' in text, text


def test_parallel_tool_calls_false_under_auto_answers_one_call_streamed_and_not():
    """Before, `auto` ignored `parallel_tool_calls: false`: both calls came back."""

    async def fn(client, fake):
        kw = dict(model="fake-model", messages=[{"role": "user", "content": "x"}],
                  tools=TOOLS, parallel_tool_calls=False, max_tokens=500)  # fmt: skip
        r = await client.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}]
        assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
        indexes, args, reasons = set(), "", []
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                reasons.append(ch.finish_reason)
                for t in ch.delta.tool_calls or ():
                    indexes.add(t.index)
                    args += t.function.arguments or ""
        assert indexes == {0} and json.loads(args) == {"city": "Paris"}, (indexes, args)
        assert reasons[-1] == "tool_calls"

    run(fn, [f"{CALL}\n{CALL_LYON}"] * 2)
