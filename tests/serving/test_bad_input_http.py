"""Malformed HTTP requests against the real server: each gets its own OpenAI error naming the
problem, and a stream in flight meanwhile finishes with exactly the text it would have had.

The table extends the transport cases of test_http_api.py (fake engine) and the engine
cases of test_http_openai.py; the in-flight test replays all three tables at once. Cases
that h11 must refuse before the app sees them (oversized headers, a broken Content-Length)
are sent over a raw socket, since an HTTP client would not send them.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.config import ServerConfig
from tests.serving.test_http_api import BAD_TRANSPORT
from tests.serving.test_http_openai import ENGINE_BAD_INPUT
from tests.support.served_stack import Stack, served, tiny_engine, wait_idle_and_free
from tests.support.waiting import HANG_S, StepGate, wait_for_async

BODY_LIMIT = 64 * 1024
HEADER_LIMIT = 8 * 1024
MSGS = [{"role": "user", "content": "hi"}]
CHAT = {"messages": MSGS, "max_tokens": 2}
CMPL = {"prompt": "hi", "max_tokens": 2}
JSON_CT = {"content-type": "application/json"}


def _raw(text: str) -> dict[str, Any]:
    """A body sent as these exact bytes (not re-encoded by the client)."""
    return {"content": text.encode("utf-8", "surrogatepass"), "headers": JSON_CT}


# (id, method, path, request kwargs, status, param, code); None: not checked.
CASES: list[tuple[str, str, str, dict[str, Any], int, str | None, str | None]] = [
    # ---- JSON syntax and encoding ---------------------------------------------------------
    ("truncated json", "POST", "/v1/completions", _raw('{"prompt": "x"'), 400, None, "invalid_json"),
    ("json string body", "POST", "/v1/completions", {"json": "hello"}, 400, None, "invalid_json"),
    ("json null body", "POST", "/v1/chat/completions", {"json": None}, 400, None, "invalid_json"),
    ("empty body", "POST", "/v1/completions", _raw(""), 400, None, "invalid_json"),
    ("invalid utf-8", "POST", "/v1/completions", {"content": b'{"prompt": "\xff\xfe"}', "headers": JSON_CT}, 400, None, "invalid_json"),
    ("nesting bomb", "POST", "/v1/completions", _raw("[" * 50_000), 400, None, "invalid_json"),
    ("5000-digit integer", "POST", "/v1/completions", _raw('{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}"), 400, None, "invalid_json"),
    ("NaN temperature", "POST", "/v1/completions", _raw('{"prompt": "x", "temperature": NaN}'), 400, "temperature", None),
    ("Infinity top_p", "POST", "/v1/completions", _raw('{"prompt": "x", "top_p": Infinity}'), 400, "top_p", None),
    ("-Infinity penalty", "POST", "/v1/completions", _raw('{"prompt": "x", "presence_penalty": -Infinity}'), 400, "presence_penalty", None),
    ("NaN logit_bias value", "POST", "/v1/completions", _raw('{"prompt": "x", "logit_bias": {"5": NaN}}'), 400, "logit_bias", None),
    ("1e999 temperature", "POST", "/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}'), 400, "temperature", None),
    ("lone surrogate prompt", "POST", "/v1/completions", _raw('{"prompt": "\\ud800 x", "max_tokens": 1}'), 400, "prompt", None),
    ("lone surrogate chat", "POST", "/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}'), 400, "messages.0.content", None),
    ("lone surrogate tokenize", "POST", "/tokenize", _raw('{"prompt": "\\ud800"}'), 400, "prompt", None),
    ("lone surrogate stop", "POST", "/v1/completions", _raw('{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 1}'), 400, "stop.0", None),
    # ---- content type, size, routes, methods ----------------------------------------------
    ("text/plain", "POST", "/v1/chat/completions", {"content": json.dumps(CHAT), "headers": {"content-type": "text/plain"}}, 415, None, "unsupported_media_type"),
    ("multipart", "POST", "/v1/completions", {"files": {"f": b"x"}}, 415, None, "unsupported_media_type"),
    ("oversized body", "POST", "/v1/completions", {"json": {"prompt": "x" * (BODY_LIMIT + 10)}}, 413, None, "request_too_large"),
    ("oversized tokenize body", "POST", "/tokenize", {"json": {"prompt": "x" * (BODY_LIMIT + 10)}}, 413, None, "request_too_large"),
    ("unknown route", "POST", "/v1/audio/speech", {"json": {}}, 404, None, "not_found"),
    ("unknown api version", "POST", "/v2/completions", {"json": CMPL}, 404, None, "not_found"),
    ("PUT completions", "PUT", "/v1/completions", {"json": CMPL}, 405, None, "method_not_allowed"),
    ("DELETE models", "DELETE", "/v1/models", {}, 405, None, "method_not_allowed"),
    ("GET tokenize", "GET", "/tokenize", {}, 405, None, "method_not_allowed"),
    ("PATCH health", "PATCH", "/health", {}, 405, None, "method_not_allowed"),
    # ---- completions fields ----------------------------------------------------------------
    ("prompt int", "POST", "/v1/completions", {"json": {"prompt": 5}}, 400, "prompt", None),
    ("prompt null", "POST", "/v1/completions", {"json": {"prompt": None}}, 400, "prompt", None),
    ("prompt object", "POST", "/v1/completions", {"json": {"prompt": {"text": "x"}}}, 400, "prompt", None),
    ("prompt mixed list", "POST", "/v1/completions", {"json": {"prompt": [1, "a"]}}, 400, "prompt", None),
    ("prompt bools", "POST", "/v1/completions", {"json": {"prompt": [True, False]}}, 400, "prompt", None),
    ("prompt empty token list in batch", "POST", "/v1/completions", {"json": {"prompt": [[1, 2], []]}}, 400, "prompt", None),
    ("prompt negative token", "POST", "/v1/completions", {"json": {"prompt": [-1, 5]}}, 400, "prompt", None),
    ("prompt empty string in batch", "POST", "/v1/completions", {"json": {"prompt": ["a", ""]}}, 400, "prompt", None),
    ("prompt token ids beyond context", "POST", "/v1/completions", {"json": {"prompt": [5] * 200}}, 400, "prompt", "context_length_exceeded"),
    ("max_tokens negative", "POST", "/v1/completions", {"json": {**CMPL, "max_tokens": -1}}, 400, "max_tokens", None),
    ("max_tokens float", "POST", "/v1/completions", {"json": {**CMPL, "max_tokens": 1.5}}, 400, "max_tokens", "invalid_type"),
    ("max_tokens bool", "POST", "/v1/completions", {"json": {**CMPL, "max_tokens": True}}, 400, "max_tokens", "invalid_type"),
    ("max_tokens huge", "POST", "/v1/completions", {"json": {**CMPL, "max_tokens": 10**30}}, 400, "max_tokens", None),
    ("n zero", "POST", "/v1/completions", {"json": {**CMPL, "n": 0}}, 400, "n", None),
    ("n string", "POST", "/v1/completions", {"json": {**CMPL, "n": "2"}}, 400, "n", "invalid_type"),
    ("temperature negative", "POST", "/v1/completions", {"json": {**CMPL, "temperature": -0.1}}, 400, "temperature", None),
    ("top_p zero", "POST", "/v1/completions", {"json": {**CMPL, "top_p": 0}}, 400, "top_p", None),
    ("top_p above 1", "POST", "/v1/completions", {"json": {**CMPL, "top_p": 1.5}}, 400, "top_p", None),
    ("top_k -2", "POST", "/v1/completions", {"json": {**CMPL, "top_k": -2}}, 400, "top_k", None),
    ("min_p above 1", "POST", "/v1/completions", {"json": {**CMPL, "min_p": 1.5}}, 400, "min_p", None),
    ("presence_penalty 2.5", "POST", "/v1/completions", {"json": {**CMPL, "presence_penalty": 2.5}}, 400, "presence_penalty", None),
    ("frequency_penalty -3", "POST", "/v1/completions", {"json": {**CMPL, "frequency_penalty": -3}}, 400, "frequency_penalty", None),
    ("repetition_penalty 0", "POST", "/v1/completions", {"json": {**CMPL, "repetition_penalty": 0}}, 400, "repetition_penalty", None),
    ("repetition_penalty 2.5", "POST", "/v1/completions", {"json": {**CMPL, "repetition_penalty": 2.5}}, 400, "repetition_penalty", None),
    ("logprobs 21", "POST", "/v1/completions", {"json": {**CMPL, "logprobs": 21}}, 400, "logprobs", None),
    ("logprobs negative", "POST", "/v1/completions", {"json": {**CMPL, "logprobs": -1}}, 400, "logprobs", None),
    ("seed string", "POST", "/v1/completions", {"json": {**CMPL, "seed": "abc"}}, 400, "seed", "invalid_type"),
    ("17 stop strings", "POST", "/v1/completions", {"json": {**CMPL, "stop": [f"s{i}" for i in range(17)]}}, 400, "stop", None),
    ("empty stop string", "POST", "/v1/completions", {"json": {**CMPL, "stop": [""]}}, 400, "stop", None),
    ("stop string over 1024 chars", "POST", "/v1/completions", {"json": {**CMPL, "stop": ["x" * 1025]}}, 400, "stop", None),
    ("chat stop string over 1024 chars", "POST", "/v1/chat/completions", {"json": {**CHAT, "stop": "x" * 1025}}, 400, "stop", None),
    ("1025 distinct stop_token_ids", "POST", "/v1/completions", {"json": {**CMPL, "stop_token_ids": list(range(1025))}}, 400, "stop_token_ids", None),
    ("stop not strings", "POST", "/v1/completions", {"json": {**CMPL, "stop": [1]}}, 400, "stop", None),
    ("negative stop_token_id", "POST", "/v1/completions", {"json": {**CMPL, "stop_token_ids": [-1]}}, 400, "stop_token_ids.0", None),
    ("logit_bias negative key", "POST", "/v1/completions", {"json": {**CMPL, "logit_bias": {"-1": 1}}}, 400, "logit_bias", None),
    ("logit_bias float key", "POST", "/v1/completions", {"json": {**CMPL, "logit_bias": {"1e3": 1}}}, 400, "logit_bias", None),
    ("logit_bias string value", "POST", "/v1/completions", {"json": {**CMPL, "logit_bias": {"5": "x"}}}, 400, "logit_bias.5", None),
    ("logit_bias list", "POST", "/v1/completions", {"json": {**CMPL, "logit_bias": [5]}}, 400, "logit_bias", None),
    ("min_tokens negative", "POST", "/v1/completions", {"json": {**CMPL, "min_tokens": -1}}, 400, "min_tokens", None),
    ("priority float", "POST", "/v1/completions", {"json": {**CMPL, "priority": 1.5}}, 400, "priority", "invalid_type"),
    ("echo string", "POST", "/v1/completions", {"json": {**CMPL, "echo": "yes"}}, 400, "echo", "invalid_type"),
    ("echo with logprobs streamed", "POST", "/v1/completions", {"json": {**CMPL, "echo": True, "logprobs": 1, "stream": True}}, 400, "echo", "unsupported_parameter"),
    ("max_tokens 0 without echo", "POST", "/v1/completions", {"json": {**CMPL, "max_tokens": 0, "logprobs": 1}}, 400, "max_tokens", None),
    ("best_of zero", "POST", "/v1/completions", {"json": {**CMPL, "best_of": 0}}, 400, "best_of", None),
    ("stream string", "POST", "/v1/completions", {"json": {**CMPL, "stream": "true"}}, 400, "stream", "invalid_type"),
    ("stream_options unknown key", "POST", "/v1/completions", {"json": {**CMPL, "stream": True, "stream_options": {"bogus": 1}}}, 400, "stream_options.bogus", "unknown_parameter"),
    ("suffix", "POST", "/v1/completions", {"json": {**CMPL, "suffix": "end"}}, 400, "suffix", "unsupported_parameter"),
    ("beam search", "POST", "/v1/completions", {"json": {**CMPL, "use_beam_search": True}}, 400, "use_beam_search", "unsupported_parameter"),
    ("prompt_logprobs streamed", "POST", "/v1/completions", {"json": {**CMPL, "prompt_logprobs": 1, "stream": True}}, 400, "prompt_logprobs", "unsupported_parameter"),
    ("prompt_logprobs over 20", "POST", "/v1/completions", {"json": {**CMPL, "prompt_logprobs": 21}}, 400, "prompt_logprobs", None),
    ("chat prompt_logprobs", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1}}, 400, "prompt_logprobs", "unknown_parameter"),
    ("model not a string", "POST", "/v1/completions", {"json": {**CMPL, "model": 5}}, 400, "model", "invalid_type"),
    ("model empty string", "POST", "/v1/completions", {"json": {**CMPL, "model": ""}}, 404, "model", "model_not_found"),
    # ---- chat fields ------------------------------------------------------------------------
    ("chat empty object", "POST", "/v1/chat/completions", {"json": {}}, 400, "messages", "missing_required_parameter"),
    ("messages not a list", "POST", "/v1/chat/completions", {"json": {"messages": "hi"}}, 400, "messages", None),
    ("message without role", "POST", "/v1/chat/completions", {"json": {"messages": [{"content": "x"}]}}, 400, "messages.0.role", "missing_required_parameter"),
    ("message unknown key", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "x", "mood": 1}]}}, 400, "messages.0.mood", "unknown_parameter"),
    ("text part without text", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": [{"type": "text"}]}]}}, 400, "messages.0.content.0.text", "missing_required_parameter"),
    ("max_completion_tokens 0", "POST", "/v1/chat/completions", {"json": {"messages": MSGS, "max_completion_tokens": 0}}, 400, "max_completion_tokens", None),
    ("chat n beyond max_n", "POST", "/v1/chat/completions", {"json": {**CHAT, "n": 17}}, 400, "n", None),
    ("chat top_logprobs 21", "POST", "/v1/chat/completions", {"json": {**CHAT, "logprobs": True, "top_logprobs": 21}}, 400, "top_logprobs", None),
    ("chat logprobs string", "POST", "/v1/chat/completions", {"json": {**CHAT, "logprobs": "true"}}, 400, "logprobs", "invalid_type"),
    ("add_generation_prompt and continue_final_message", "POST", "/v1/chat/completions", {"json": {**CHAT, "continue_final_message": True}}, 400, "continue_final_message", None),
    ("chat_template_kwargs not a dict", "POST", "/v1/chat/completions", {"json": {**CHAT, "chat_template_kwargs": "x"}}, 400, "chat_template_kwargs", None),
    ("chat_template_kwargs tokenize false", "POST", "/v1/chat/completions", {"json": {**CHAT, "chat_template_kwargs": {"tokenize": False}}}, 400, "chat_template_kwargs.tokenize", None),
    ("client-sent chat template", "POST", "/v1/chat/completions", {"json": {**CHAT, "chat_template_kwargs": {"chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"}}}, 400, "chat_template_kwargs.chat_template", None),
    ("metadata non-string value", "POST", "/v1/chat/completions", {"json": {**CHAT, "metadata": {"a": 1}}}, 400, "metadata.a", "invalid_type"),
    ("functions", "POST", "/v1/chat/completions", {"json": {**CHAT, "functions": [{"name": "f"}]}}, 400, "functions", "unsupported_parameter"),
    ("audio modality", "POST", "/v1/chat/completions", {"json": {**CHAT, "modalities": ["audio"]}}, 400, "modalities", "unsupported_parameter"),
    ("chat prompt beyond context", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "one two " * 200}]}}, 400, "messages", "context_length_exceeded"),
    # ---- tokenizer routes -------------------------------------------------------------------
    ("tokenize neither", "POST", "/tokenize", {"json": {}}, 400, "prompt", None),
    ("tokenize prompt int", "POST", "/tokenize", {"json": {"prompt": 5}}, 400, "prompt", "invalid_type"),
    ("tokenize empty messages", "POST", "/tokenize", {"json": {"messages": []}}, 400, "messages", None),
    ("detokenize negative", "POST", "/detokenize", {"json": {"tokens": [-1]}}, 400, "tokens.0", None),
    ("detokenize string", "POST", "/detokenize", {"json": {"tokens": "abc"}}, 400, "tokens", None),
    ("detokenize missing", "POST", "/detokenize", {"json": {}}, 400, "tokens", "missing_required_parameter"),
    ("detokenize huge id", "POST", "/detokenize", {"json": {"tokens": [10**30]}}, 400, "tokens", None),
    # ---- R2 (issue 19, finding 10): seeds are int64, logit_bias keys canonical ids -----------
    ("seed 2**63", "POST", "/v1/completions", {"json": {**CMPL, "seed": 2**63}}, 400, "seed", None),
    ("seed 2**64 (wrapped to 0)", "POST", "/v1/completions", {"json": {**CMPL, "seed": 2**64}}, 400, "seed", None),
    ("seed below -2**63", "POST", "/v1/chat/completions", {"json": {**CHAT, "seed": -(2**63) - 1}}, 400, "seed", None),
    ("logit_bias key with a space", "POST", "/v1/completions", {"json": {**CMPL, "logit_bias": {" 5": 1}}}, 400, "logit_bias", None),
    ("logit_bias key with a plus", "POST", "/v1/completions", {"json": {**CMPL, "logit_bias": {"+5": 1}}}, 400, "logit_bias", None),
    ("logit_bias key with an underscore", "POST", "/v1/completions", {"json": {**CMPL, "logit_bias": {"5_0": 1}}}, 400, "logit_bias", None),
    ("logit_bias key in arabic digits", "POST", "/v1/chat/completions", {"json": {**CHAT, "logit_bias": {"\u0665": 1}}}, 400, "logit_bias", None),
    ("logit_bias key with a leading zero", "POST", "/v1/completions", {"json": {**CMPL, "logit_bias": {"5": 1, "05": -1}}}, 400, "logit_bias", None),
    # ---- structured outputs (issue 16) ------------------------------------------------------
    ("guided_json a number", "POST", "/v1/completions", {"json": {**CMPL, "guided_json": 5}}, 400, "guided_json", None),
    ("guided_choice empty", "POST", "/v1/completions", {"json": {**CMPL, "guided_choice": []}}, 400, "guided_choice", None),
    ("guided_regex not a string", "POST", "/v1/chat/completions", {"json": {**CHAT, "guided_regex": ["a"]}}, 400, "guided_regex", None),
    ("response_format unknown type", "POST", "/v1/chat/completions", {"json": {**CHAT, "response_format": {"type": "xml"}}}, 400, "response_format.type", None),
    ("json_schema without schema", "POST", "/v1/chat/completions", {"json": {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}}, 400, "response_format.json_schema.schema", None),
    ("json_schema schema not an object", "POST", "/v1/completions", {"json": {**CMPL, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "str"}}}}, 400, "response_format.json_schema.schema", None),
    ("structured_outputs two kinds", "POST", "/v1/completions", {"json": {**CMPL, "structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}}, 400, "structured_outputs.grammar", None),
    ("two constraint fields", "POST", "/v1/chat/completions", {"json": {**CHAT, "response_format": {"type": "json_object"}, "guided_choice": ["a"]}}, 400, "guided_choice", None),
    # ---- end structured outputs -------------------------------------------------------------
]  # fmt: skip


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    llm = tiny_engine(tiny_llama_dir)
    server = ServerConfig(
        host="127.0.0.1", max_request_body=BODY_LIMIT, max_header_bytes=HEADER_LIMIT
    )
    with served(llm, server) as s:
        yield s


def _check(r: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def test_the_table_has_at_least_fifty_distinct_cases() -> None:
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 50


@pytest.mark.parametrize(
    "method, path, kwargs, status, param, code", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_request_gets_an_openai_error_naming_the_problem(
    stack: Stack, method, path, kwargs, status, param, code
) -> None:
    with httpx.Client(base_url=stack.url, timeout=HANG_S) as c:
        _check(c.request(method, path, **kwargs), status, param, code)


def _raw_exchange(url: str, payload: bytes) -> tuple[int, dict]:
    """Sends bytes no HTTP client would send; returns (status, parsed JSON body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_S) as sock:
        try:
            sock.sendall(payload)
        except OSError:  # the server may answer and close before reading everything
            pass
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_oversized_headers_are_431_before_any_route_runs(stack: Stack) -> None:
    big = b"x" * (HEADER_LIMIT + 1024)
    payload = (
        b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\nX-Junk: " + big + b"\r\n\r\n"
    )
    status, body = _raw_exchange(stack.url, payload)
    assert status == 431 and body["error"]["code"] == "headers_too_large", body
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"y" * 100) for i in range(200))
    head = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
    status, body = _raw_exchange(stack.url, head + many + b"\r\n")
    assert status == 431, body
    assert httpx.get(f"{stack.url}/health").status_code == 200


def test_broken_framing_is_a_400_in_openai_format(stack: Stack) -> None:
    bad_length = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n{}"
    status, body = _raw_exchange(stack.url, bad_length)
    assert status == 400 and body["error"]["code"] == "invalid_http", body
    status, body = _raw_exchange(stack.url, b"NOT-HTTP\r\n\r\n")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def _all_bad_requests() -> list[tuple[str, str, dict[str, Any], int]]:
    """Every malformed request of the three tables as (method, path, kwargs, status)."""
    out = [(m, p, kw, status) for _, m, p, kw, status, _, _ in CASES]
    out += [("POST", p, kw, status) for _, p, kw, status, _, _ in BAD_TRANSPORT]
    out += [("POST", p, {"json": body}, 400) for _, p, body, _, _ in ENGINE_BAD_INPUT]
    return out


def test_a_stream_in_flight_finishes_untouched_by_every_bad_request(stack: Stack) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    expected = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=HANG_S).json()
    bad = _all_bad_requests()
    # One token, then held until every bad request is answered: the stream outlasts them all.
    gate = StepGate(stack.aeng.engine, permits=1)

    async def main() -> tuple[str, list[int], bool]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=stack.url, timeout=HANG_S, limits=limits) as c:
            text = []
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                rid = r.headers["x-request-id"]
                await wait_for_async(lambda: gate.steps == 1, "the stream running")
                statuses = await asyncio.gather(*[c.request(m, p, **kw) for m, p, kw, _ in bad])
                # Still streaming afterwards? (Rejected requests may linger a step in the
                # engine's table while their aborts land, so look for this stream's id.)
                overlapped = rid in stack.aeng._streams
                gate.open()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += [ch["text"] for ch in json.loads(line[6:])["choices"]]
            return "".join(text), [s.status_code for s in statuses], overlapped

    try:
        text, statuses, overlapped = asyncio.run(main())
    finally:
        gate.remove()
    assert statuses == [status for _, _, _, status in bad]
    assert overlapped, "the stream ended before the bad requests did"
    assert text == expected["choices"][0]["text"]
    wait_idle_and_free(stack.aeng)
