"""Tool-call and reasoning parsers on crafted answers: each family whole, streamed in two
pieces split at every position (the same result), malformed calls as plain content."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from appliance.dialect.chat_output import (
    ChoiceStream,
    DialectError,
    chat_dialect,
    parse_choice,
)
from appliance.dialect.reasoning import ReasoningStream, split_reasoning
from appliance.dialect.tool_grammar import tool_call_grammar
from appliance.dialect.tool_parsers import ToolCallStream, parse_tool_calls
from appliance.dialect.tools_prompt import parser_for_template, prepare_messages

WEATHER = {"city": "Paris", "unit": "c", "tags": ["a", "}"], "q": 'say "hi" {x}'}
CASES = {
    "hermes": (
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    ),
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": '
    + json.dumps(WEATHER)
    + '}; {"name": "now", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": '
    + json.dumps(WEATHER)
    + '}, {"name": "now", "arguments": {}}]',
}
NAMES = {"get_weather", "now"}


@pytest.mark.parametrize("parser", sorted(CASES))
def test_each_family_parses_two_calls(parser):
    out = parse_tool_calls(CASES[parser], parser, NAMES)
    assert [c.name for c in out.tool_calls] == ["get_weather", "now"]
    assert json.loads(out.tool_calls[0].arguments) == WEATHER
    assert json.loads(out.tool_calls[1].arguments) == {}
    assert out.content == ("Let me check." if parser == "hermes" else None)
    assert all(c.id.startswith("call_") for c in out.tool_calls)


def _streamed(parser: str, pieces: list[str]):
    s = ToolCallStream(parser)
    deltas = [s.feed(p) for p in pieces] + [s.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for t in d.tool_calls:
            if t.id is not None:
                assert t.index not in calls  # id and name come once, first
                calls[t.index] = {"name": t.name, "arguments": ""}
            calls[t.index]["arguments"] += t.arguments
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("parser", sorted(CASES))
def test_a_stream_split_at_every_position_gives_the_whole_answer(parser):
    text = CASES[parser]
    whole = parse_tool_calls(text, parser, NAMES)
    expected = [{"name": c.name, "arguments": c.arguments} for c in whole.tool_calls]
    for i in range(len(text) + 1):
        content, calls = _streamed(parser, [text[:i], text[i:]])
        assert calls == expected, i
        assert content == (whole.content or ""), i
    content, calls = _streamed(parser, list(text))  # one character at a time
    assert calls == expected and content == (whole.content or "")


def test_arguments_stream_in_fragments_after_the_name():
    s = ToolCallStream("hermes")
    first = s.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert [(t.index, t.name) for t in first.tool_calls] == [(0, "get_weather")]
    assert "".join(t.arguments for t in first.tool_calls) == '{"ci'
    more = s.feed('ty": "Paris"}}</tool_call>')
    assert [(t.index, t.id, t.name, t.arguments) for t in more.tool_calls] == [
        (0, None, None, 'ty": "Paris"}')
    ]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>',
        '<tool_call>{"name": "get_weather"}</tool_call>',
        '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut off
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "now", "arguments": "x"}</tool_call>',
    ],
)
def test_a_malformed_call_is_plain_content(text):
    out = parse_tool_calls(text, "hermes", NAMES)
    assert out.tool_calls == [] and out.content == text


def test_plain_text_and_text_that_looks_like_a_marker_stay_content():
    for parser in CASES:
        assert parse_tool_calls("Hello <tool a> [x] {y}", parser, NAMES).content == (
            "Hello <tool a> [x] {y}"
        )
    content, calls = _streamed("hermes", list("a <tool_c b"))
    assert (content, calls) == ("a <tool_c b", [])


def test_reasoning_split_whole_and_streamed_at_every_position():
    text = "<think>\nstep 1 < 2\n</think>\n\nThe answer."
    assert split_reasoning(text, "qwen3") == ("\nstep 1 < 2\n", "The answer.")
    assert split_reasoning("no thoughts", "qwen3") == (None, "no thoughts")
    assert split_reasoning("thinking</think>done", "deepseek_r1") == ("thinking", "done")
    assert split_reasoning("cut mid thought", "deepseek_r1") == ("cut mid thought", "")
    for i in range(len(text) + 1):
        s = ReasoningStream("qwen3")
        parts = [s.feed(text[:i]), s.feed(text[i:]), s.finish()]
        assert "".join(p.reasoning for p in parts) == "\nstep 1 < 2\n", i
        assert "".join(p.content for p in parts) == "The answer.", i


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}},
]  # fmt: skip


def test_reasoning_then_a_tool_call_in_one_choice():
    d = chat_dialect(TOOLS, "auto", None, "hermes", "qwen3", None)
    text = '<think>need weather</think><tool_call>{"name": "now", "arguments": {}}</tool_call>'
    r = parse_choice(d, text)
    assert r.reasoning == "need weather" and r.content is None
    assert [c.name for c in r.tool_calls] == ["now"]
    s = ChoiceStream(d)
    parts = [s.feed(ch) for ch in text] + [s.finish()]
    assert "".join(p.reasoning for p in parts) == "need weather"
    assert [t.name for p in parts for t in p.tool_calls if t.name] == ["now"]


def test_required_and_named_tool_choice_build_a_grammar_in_the_parser_format():
    req = chat_dialect(TOOLS, "required", None, "auto", "none", None).constraint()
    assert req.grammar.startswith('start: call ("\\n" call)*')
    assert '"const": "get_weather"' in req.grammar and '"const": "now"' in req.grammar
    assert req.start_after is None
    named = chat_dialect(
        TOOLS, {"type": "function", "function": {"name": "now"}}, None, "mistral", "qwen3", None
    ).constraint()
    assert named.grammar.startswith('start: "[TOOL_CALLS][" body "]"')
    assert "get_weather" not in named.grammar and named.start_after == "</think>"
    assert chat_dialect(TOOLS, "auto", None, "auto", "none", None).constraint() is None
    for parser in CASES:
        for parallel in (True, False):
            grammar = tool_call_grammar(TOOLS, parser, parallel)
            assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar)) == ""


def test_dialect_refuses_what_it_cannot_serve():
    with pytest.raises(DialectError) as e:
        chat_dialect(
            TOOLS, {"type": "function", "function": {"name": "x"}}, None, "auto", "none", None
        )
    assert e.value.param == "tool_choice"
    with pytest.raises(DialectError) as e:
        chat_dialect(TOOLS, "auto", None, "none", "none", None)
    assert e.value.param == "tools"
    assert chat_dialect(TOOLS, "none", None, "auto", "none", None).tool_parser is None
    off = chat_dialect(None, None, None, "auto", "qwen3", None, enable_thinking=False)
    assert off.reasoning_parser is None


def test_auto_parser_follows_the_template_and_fallback_renders_tools_as_text():
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|python_tag|>") == "llama3"
    assert parser_for_template(None) == "hermes"
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
    ]  # fmt: skip
    msgs, tools = prepare_messages(history, TOOLS, native=False)
    assert tools is None and msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
    assert msgs[2] == {
        "role": "assistant",
        "content": '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
    }
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    native, tools = prepare_messages(history, TOOLS, native=True)
    assert tools == TOOLS and native[1]["tool_calls"][0]["function"]["arguments"] == {}


def test_a_forced_call_is_compact_json_with_no_whitespace_between_tokens(tiny_llama_dir):
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer = llguidance.hf.from_tokenizer(hf)
    grammar = LLMatcher.grammar_from_lark(tool_call_grammar(TOOLS, "llama3", parallel=False))

    def accepts(text: str) -> bool:
        m = LLMatcher(tokenizer, grammar, log_level=0)
        return all(m.consume_token(t) for t in hf.encode(text, add_special_tokens=False))

    assert accepts('{"name":"now"')
    assert not accepts('{ "name":"now"')  # a blank after "{" could repeat to max_tokens
    assert not accepts('{"name": "now"')


def _stream_all(dialect, pieces):
    cs = ChoiceStream(dialect)
    outs = [cs.feed(p) for p in pieces] + [cs.finish()]
    content = "".join(o.content for o in outs)
    calls: dict[int, list[str]] = {}
    for o in outs:
        for d in o.tool_calls:
            if d.name is not None:
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return content, calls, cs.called


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # cut JSON
        '<tool_call>\n{"name": "nope", "arguments": {"city": "Rome"}}\n</tool_call>',  # unknown
        '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # not an object
    ],
)
def test_under_auto_a_streamed_malformed_call_comes_back_as_content_at_any_split(bad):
    dialect = chat_dialect(TOOLS, "auto", None, "hermes", "none", None)
    text = "Let me see. " + bad
    for cut in range(1, len(text)):
        content, calls, called = _stream_all(dialect, [text[:cut], text[cut:]])
        assert (content, calls, called) == (text, {}, False), cut


def test_under_auto_a_streamed_valid_call_is_sent_whole_at_the_end_name_first():
    dialect = chat_dialect(TOOLS, "auto", None, "hermes", "none", None)
    text = 'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    for cut in range(1, len(text)):
        content, calls, called = _stream_all(dialect, [text[:cut], text[cut:]])
        assert content == "Let me see. " and called
        assert {i: (n, json.loads(a)) for i, (n, a) in calls.items()} == {
            0: ("get_weather", {"city": "Rome"})
        }
