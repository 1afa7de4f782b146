"""What a router in front of the server relies on, against the real server on the tiny model.

vllm-router (docs/scaling.md) asks a replica for the prompt's token ids before it routes
(`/v1/completions/render`, `/v1/chat/completions/render`), and forwards bodies with a few
SGLang-dialect fields always set to their defaults. The render routes must return the ids
the generation route feeds the model, check the body as that route does, and generate
nothing; the forwarded bodies must be served, and the same fields with another value
refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.http.app import build_app
from appliance.http.server import BackgroundServer
from engine.async_engine import AsyncEngine
from tests.support.served_stack import tiny_engine
from tests.support.waiting import HANG_S

MSGS = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
]
# The fields vllm-router 0.1.17 writes into every body it forwards, with their values.
ROUTER_CHAT_FIELDS = {
    "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True,
}  # fmt: skip
ROUTER_COMPLETION_FIELDS = {
    "echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
    "return_hidden_states": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[tuple[str, AsyncEngine]]:
    aeng = AsyncEngine(tiny_engine(tiny_llama_dir))
    with BackgroundServer(build_app(aeng)) as srv:
        yield srv.url, aeng
    import asyncio

    asyncio.run(aeng.shutdown())


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=HANG_S)


def test_chat_render_is_the_prompt_the_chat_route_feeds_the_model(server) -> None:
    url, _ = server
    r = _post(url, "/v1/chat/completions/render", {"model": "tiny", "messages": MSGS})
    assert r.status_code == 200, r.text
    body = r.json()
    tokens = _post(url, "/tokenize", {"messages": MSGS}).json()["tokens"]
    assert body == {"model": "tiny", "token_ids": tokens}
    chat = _post(url, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(tokens)
    # The chat template's own switches reach the render as they reach generation.
    cont = {"messages": MSGS, "add_generation_prompt": False, "continue_final_message": True}
    rendered = _post(url, "/v1/chat/completions/render", cont).json()["token_ids"]
    assert rendered != tokens and rendered == tokens[: len(rendered)]


def test_completion_render_answers_one_entry_per_prompt_in_order(server) -> None:
    url, _ = server
    texts = ["Once upon a time", "Water boils"]
    r = _post(url, "/v1/completions/render", {"prompt": texts, "max_tokens": 3})
    assert r.status_code == 200, r.text
    ids = [_post(url, "/tokenize", {"prompt": t}).json()["tokens"] for t in texts]
    assert r.json() == [{"model": "tiny", "token_ids": i} for i in ids]
    for prompt, want in (([5, 6, 7], [[5, 6, 7]]), ([[5, 6], [7]], [[5, 6], [7]])):
        r = _post(url, "/v1/completions/render", {"prompt": prompt})
        assert r.json() == [{"model": "tiny", "token_ids": w} for w in want]


def test_render_checks_the_body_as_generation_does_and_generates_nothing(server) -> None:
    url, aeng = server
    before = aeng.stats().prompt_tokens_total
    cases = [
        ("/v1/completions/render", {"prompt": "x", "temperature": 5}, 400, "temperature"),
        ("/v1/completions/render", {"prompt": []}, 400, "prompt"),
        ("/v1/completions/render", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions/render", {"messages": MSGS, "top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions/render", {"messages": MSGS, "continue_final_message": True},
         400, "continue_final_message"),
        ("/v1/chat/completions/render", {"messages": MSGS, "frobnicate": 1}, 400, "frobnicate"),
    ]  # fmt: skip
    for path, body, status, param in cases:
        r = _post(url, path, body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, r.text)
        # the generation route answers the same body the same way
        gen = _post(url, path.removesuffix("/render"), body)
        assert (gen.status_code, gen.json()["error"]["param"]) == (status, param), gen.text
    _post(url, "/v1/completions/render", {"prompt": "counted nowhere"}).raise_for_status()
    assert aeng.stats().prompt_tokens_total == before  # nothing reached the engine


def test_bodies_as_the_router_forwards_them_are_served(server) -> None:
    url, _ = server
    chat = {"model": "tiny", "messages": MSGS, "max_tokens": 2, **ROUTER_CHAT_FIELDS}
    r = _post(url, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    cmpl = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **ROUTER_COMPLETION_FIELDS}
    r = _post(url, "/v1/completions", cmpl)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "field, value",
    [
        ("no_stop_trim", True),
        ("return_hidden_states", True),
        ("separate_reasoning", False),
        ("stream_reasoning", False),
        ("include_reasoning", False),
    ],
)
def test_router_dialect_fields_other_than_their_default_are_refused_by_name(
    server, field, value
) -> None:
    url, _ = server
    r = _post(url, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (field, "unsupported_parameter")


# ---- issue 28, E13: one validation for the render, tokenize and generation routes ----------
VOCAB_CASES = [
    ("/v1/completions/render", {"prompt": [5, -1]}, 400, "prompt"),
    ("/v1/completions/render", {"prompt": [5, 10**9]}, 400, "prompt"),
    ("/v1/completions/render", {"prompt": "x", "structured_outputs": {"regex": "(a"}}, 400,
     "structured_outputs.regex"),
    ("/v1/completions/render", {"prompt": [5] * 1000}, 400, "prompt"),
    ("/v1/chat/completions/render", {"messages": MSGS, "structured_outputs": {"regex": "(a"}},
     400, "structured_outputs.regex"),
]  # fmt: skip


@pytest.mark.parametrize("path, body, status, param", VOCAB_CASES)
def test_render_refuses_what_generation_refuses(server, path, body, status, param) -> None:
    """Token ids outside the vocabulary, a prompt over the context, a constraint that does
    not compile: the engine's own checks, which the render route skipped."""
    url, aeng = server
    before = aeng.stats().prompt_tokens_total
    gen = _post(url, path.removesuffix("/render"), {**body, "max_tokens": 1})
    assert (gen.status_code, gen.json()["error"]["param"]) == (status, param), gen.text
    r = _post(url, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert aeng.stats().prompt_tokens_total == before


def test_tokenize_refuses_the_messages_chat_refuses(server) -> None:
    url, _ = server
    msgs = [*MSGS, {"role": "tool", "tool_call_id": "c1"}]  # a tool message without content
    chat = _post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["param"] == "messages.2.content", chat.text
    for path in ("/tokenize", "/v1/chat/completions/render"):
        r = _post(url, path, {"messages": msgs})
        assert (r.status_code, r.json()["error"]) == (400, chat.json()["error"]), (path, r.text)
