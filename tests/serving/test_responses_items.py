"""Input items into chat messages, and engine text into output items, without a server: the
conversation rules (calls join their assistant turn, reasoning goes to the next assistant
turn, an output must answer an earlier call) and the builder's item boundaries."""

from __future__ import annotations

import pytest

from appliance.dialect.chat_output import chat_dialect
from appliance.responses.builder import OutputBuilder
from appliance.responses.errors import ResponsesError
from appliance.responses.items import canonical_items, encode_reasoning, to_messages

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _messages(raw: list[dict]) -> list[dict]:
    items = canonical_items(raw)
    return to_messages(items, [f"input.{i}" for i in range(len(items))])


def test_calls_join_the_assistant_turn_and_reasoning_goes_to_it():
    msgs = _messages([
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": [], "encrypted_content": encode_reasoning("think")},
        {"role": "assistant", "content": "Let me see."},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "one"}]},
    ])  # fmt: skip
    assert msgs == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me see.", "reasoning_content": "think",
         "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
         ]},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
    ]  # fmt: skip


def test_an_output_before_its_call_is_refused_naming_it():
    with pytest.raises(ResponsesError) as e:
        _messages([
            {"type": "function_call_output", "call_id": "c1", "output": "x"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        ])  # fmt: skip
    assert e.value.param == "input.0.call_id"


def test_canonical_items_all_have_ids_and_text_parts():
    items = canonical_items([{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "yo", "id": "msg_keep"}])  # fmt: skip
    assert items[0]["id"].startswith("msg_") and items[1]["id"] == "msg_keep"
    assert items[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert items[1]["content"] == [{"type": "output_text", "text": "yo", "annotations": []}]


def _build(text_pieces: list[str], reasoning: str | None = None) -> list:
    dialect = chat_dialect(TOOLS, None, None, "hermes", reasoning or "none", None)
    b = OutputBuilder(dialect)
    for i, piece in enumerate(text_pieces):
        b.step(piece, None, i == len(text_pieces) - 1)
    b.finish(incomplete=False)
    return b.items


def test_blanks_around_a_call_make_no_message():
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    items = _build(["\n ", "\n", call, "\n"])
    assert [i.type for i in items] == ["function_call"]


def test_the_same_text_in_any_chunking_makes_the_same_items():
    text = '<think>hm</think>Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    whole = _build([text], "qwen3")
    chars = _build(list(text), "qwen3")
    strip = [(i.type, i.model_dump(exclude={"id", "call_id"})) for i in whole]
    assert strip == [(i.type, i.model_dump(exclude={"id", "call_id"})) for i in chars]
    assert [i.type for i in whole] == ["reasoning", "message", "function_call"]
