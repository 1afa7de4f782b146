"""With a reasoning parser, a constraint starts where the answer does (issue 28, A3).

Where the model's first token stands is read from the rendered prompt's end and the
parser: a prompt that opens `<think>` (deepseek_r1's templates) makes it reasoning, so the
constraint waits for `</think>`; a prompt that closes an empty section (thinking disabled)
makes it content, so the constraint starts at once; otherwise deepseek_r1 reads the answer
as reasoning until `</think>` and qwen3 only when the answer opens with `<think>`: there
the constraint starts at once unless the first token is that marker. The parser splits the
text by the same decision, so what it calls content is what the grammar constrained.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from appliance.config import ServerConfig
from appliance.dialect.reasoning import ReasoningStream, answer_start
from engine import StructuredOutputsParams
from engine.worker.structured.bitmask import fill_bitmask
from engine.worker.structured.compiler import GrammarCompiler
from engine.worker.structured.matcher import GrammarState
from tests.support.served_stack import Stack, served, tiny_engine
from tests.support.waiting import HANG_S

# Bounded answers: a random model may otherwise write digits or a string until max_tokens.
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
          "additionalProperties": False}  # fmt: skip
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"days": {"enum": [1, 2, 3]}}, "required": ["days"],
    "additionalProperties": False}}}  # fmt: skip
CHATML_TAIL = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "parser, tail, start",
    [
        ("qwen3", CHATML_TAIL, "either"),
        ("qwen3", CHATML_TAIL + "<think>\n\n</think>\n\n", "content"),
        ("qwen3", CHATML_TAIL + "<think>\n", "reasoning"),
        ("deepseek_r1", "<｜User｜>Hi<｜Assistant｜><think>\n", "reasoning"),
        ("deepseek_r1", "<｜User｜>Hi<｜Assistant｜>", "reasoning"),
        ("deepseek_r1", "<｜Assistant｜><think>\n\n</think>\n\n", "content"),
        ("qwen3", "user said <think> earlier<|im_end|>\n<|im_start|>assistant\n", "either"),
    ],
)
def test_where_the_answer_starts_is_read_from_the_prompts_end(parser, tail, start) -> None:
    assert answer_start(parser, tail) == start


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_the_parser_splits_by_the_same_decision(parser) -> None:
    def split(start: str, text: str) -> tuple[str, str]:
        s = ReasoningStream(parser, start)
        a, b = s.feed(text), s.finish()
        return a.reasoning + b.reasoning, a.content + b.content

    assert split("content", '{"a":1}') == ("", '{"a":1}')
    assert split("reasoning", 'hmm</think>{"a":1}') == ("hmm", '{"a":1}')
    assert split("either", '<think>hmm</think>{"a":1}') == ("hmm", '{"a":1}')


@pytest.fixture(scope="module")
def think_tok(tmp_path_factory):
    """The tiny tokenizer with `<think>` and `</think>` as single added tokens (as Qwen3's)."""
    from tests.support.tiny_models import make_tokenizer

    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.add_tokens(["<think>", "</think>"])
    return tok


def test_an_optional_section_opens_only_on_its_first_token(think_tok) -> None:
    c = GrammarCompiler(think_tok, 520, {think_tok.eos_token_id})
    try:
        g = c.compile(StructuredOutputsParams(regex="[0-9]+"))
        (open_id,) = c.marker_token_ids("<think>")
        (close_id,) = c.marker_token_ids("</think>")
        g = dataclasses.replace(g, open_token_ids=frozenset({open_id}))
        ex = __import__("llguidance").LLExecutor()

        thinking = GrammarState(g, start_after="</think>", optional=True)
        assert thinking.active  # undecided: the grammar's tokens and the opener are allowed
        mask = fill_bitmask(ex, [(0, thinking.matcher)], 1, 520, g.eos_token_id, [0])
        thinking.widen(mask[0])
        bits = __import__("numpy").unpackbits(mask[0].view("uint8"), bitorder="little")
        assert bits[open_id] == 1 and bits[think_tok.convert_tokens_to_ids("x")] == 0
        thinking.advance(open_id)
        assert not thinking.active
        for tok in think_tok.encode("any text", add_special_tokens=False) + [close_id]:
            thinking.advance(tok)
        assert thinking.active and thinking.error() is None

        answering = GrammarState(g, start_after="</think>", optional=True)
        (seven,) = think_tok.encode("7", add_special_tokens=False)
        answering.advance(seven)  # not the opener: the constraint started with it
        assert answering.active and answering.matcher.is_accepting()
        mask = fill_bitmask(ex, [(0, answering.matcher)], 1, 520, g.eos_token_id, [0])
        answering.widen(mask[0])
        bits = __import__("numpy").unpackbits(mask[0].view("uint8"), bitorder="little")
        assert bits[open_id] == 0  # only the first token may open the section
    finally:
        c.close()


# ---- served: the tiny random model, which never writes <think> itself ---------------------
@pytest.fixture(scope="module")
def qwen3(tiny_llama_dir: Path) -> Iterator[Stack]:
    server = ServerConfig(host="127.0.0.1", http_port=0, reasoning_parser="qwen3")
    with served(tiny_engine(tiny_llama_dir, max_model_len=512), server) as s:
        yield s


def _chat(s: Stack, **body) -> dict:
    body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
            "max_tokens": 48, **body}  # fmt: skip
    r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_qwen3_an_answer_without_think_is_constrained_from_its_first_token(qwen3) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    c = _chat(qwen3, response_format=rf)
    assert c["finish_reason"] == "stop", c
    jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    assert c["message"]["reasoning_content"] is None


def test_qwen3_choice_and_a_forced_call_hold_too(qwen3) -> None:
    c = _chat(qwen3, guided_choice=["yes", "no"])
    assert (c["finish_reason"], c["message"]["content"]) in {("stop", "yes"), ("stop", "no")}, c
    c = _chat(
        qwen3, tools=[TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=120
    )
    assert c["finish_reason"] == "tool_calls", c
    (call,) = c["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["days"] in (1, 2, 3)


DEEPSEEK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% if open_think is defined and not open_think %}"
    "{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def deepseek(tiny_llama_dir: Path, tmp_path_factory) -> Iterator[tuple[Stack, list]]:
    """deepseek_r1 on a copy of the tiny checkpoint whose template opens <think> in the
    prompt (or, with `open_think: false`, closes an empty one); records what the engine got."""
    model = tmp_path_factory.mktemp("r1") / "model"
    shutil.copytree(tiny_llama_dir, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = DEEPSEEK_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    server = ServerConfig(host="127.0.0.1", http_port=0, reasoning_parser="deepseek_r1")
    with served(tiny_engine(model, max_model_len=512), server) as s:
        seen: list = []
        inner = s.aeng.add_requests  # how the HTTP routes queue a request's prompts

        async def recording(prompts, params, *a, **kw):
            seen.append(params.structured_outputs)
            return await inner(prompts, params, *a, **kw)

        s.aeng.add_requests = recording
        yield s, seen


def test_deepseek_r1_waits_for_think_end_when_the_prompt_opened_it(deepseek) -> None:
    s, seen = deepseek
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    seen.clear()
    c = _chat(s, response_format=rf, max_tokens=8)
    assert (seen[-1].start_after, seen[-1].opened_by) == ("</think>", None)
    assert c["message"]["content"] in (None, "")  # it never closed the section: all reasoning
    seen.clear()
    c = _chat(s, response_format=rf, chat_template_kwargs={"open_think": False})
    assert seen[-1].start_after is None  # closed in the prompt: constrained at once
    jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    assert c["message"]["reasoning_content"] is None
