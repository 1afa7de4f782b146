"""The Responses field policy and its bad inputs: every field today's openai SDK can send has
a row (honored, ignored or refused), the request model declares exactly the rows it
accepts, docs/responses.md lists the same rows, and each refusal is a 400 (or 404) naming
the field, with the engine never asked."""

from __future__ import annotations

import asyncio
import re
import typing
from pathlib import Path

import httpx
import pytest
from openai.types.responses import response_create_params

from appliance.config import ServerConfig
from appliance.http.app import build_app
from appliance.responses.fields import FIELDS, HONORED, IGNORED, REFUSED
from appliance.responses.protocol import ResponsesRequest
from appliance.responses.store import ResponseStore
from engine.async_engine import AsyncEngine
from tests.support.fake_engine import FakeLLMEngine
from tests.support.waiting import HANG_S

DOC = Path(__file__).resolve().parents[2] / "docs" / "responses.md"
FN_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def test_every_field_the_sdk_sends_has_a_policy_row():
    sdk = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    assert sdk - set(FIELDS) == set()


def test_the_request_model_declares_exactly_the_accepted_rows():
    accepted = {k for k, p in FIELDS.items() if p.kind in (HONORED, IGNORED)}
    declared = {f.alias or name for name, f in ResponsesRequest.model_fields.items()}
    assert declared == accepted
    assert {p.kind for p in FIELDS.values()} == {HONORED, IGNORED, REFUSED}


def test_docs_list_every_row_with_its_kind():
    rows = dict(
        re.findall(r"^\| `([a-z_]+)` \| (honored|ignored|refused) \|", DOC.read_text(), re.M)
    )
    assert rows == {k: p.kind for k, p in FIELDS.items()}


def _post(body: dict, *, path: str = "/v1/responses", store=None, fake=None, method="POST"):
    async def main():
        eng = fake or FakeLLMEngine(max_model_len=256)
        aeng = AsyncEngine(eng)
        app = build_app(aeng, ServerConfig(), responses_store=store)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            try:
                r = await c.request(method, path, json=body if method == "POST" else None)
            finally:
                await aeng.shutdown()
        return r, eng

    return asyncio.run(asyncio.wait_for(main(), HANG_S))


BAD = [
    # (body, status, param, code)
    ({"input": "x", "background": True}, 400, "background", "unsupported_parameter"),
    ({"input": "x", "conversation": "conv_1"}, 400, "conversation", "unsupported_parameter"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, 400, "prompt", "unsupported_parameter"),
    ({"input": "x", "context_management": [{"type": "compaction"}]}, 400, "context_management",
     "unsupported_parameter"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type", "unsupported_parameter"),
    ({"input": "x", "tools": [FN_TOOL, {"type": "file_search", "vector_store_ids": []}]}, 400,
     "tools.1.type", "unsupported_parameter"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, 400, "tools.0.name",
     "invalid_value"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}, "tools": [FN_TOOL]}, 400,
     "tool_choice.type", "unsupported_parameter"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "g"}, "tools": [FN_TOOL]}, 400,
     "tool_choice", "invalid_value"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation", "unsupported_parameter"),
    ({"input": "x", "include": ["reasoning.bogus"]}, 400, "include.0", "invalid_value"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, 400, "stream_options",
     "invalid_value"),
    ({"input": "x", "prompt_cache_options": {"prewarm": True}}, 400, "prompt_cache_options.prewarm",
     "unsupported_parameter"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata", "invalid_value"),
    ({"input": "x", "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", "invalid_value"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, 400,
     "text.format.schema", "invalid_value"),
    ({"input": ""}, 400, "input", "invalid_value"),
    ({"input": []}, 400, "input", "invalid_value"),
    ({}, 400, "input", "missing_required_parameter"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input.0.type",
     "unsupported_parameter"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.0.type",
     "unsupported_parameter"),
    ({"input": [{"content": "no role or type"}]}, 400, "input.0.type", "missing_required_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content.0.type", "unsupported_parameter"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input.0.role", "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]}, 400,
     "input.0.arguments", "missing_required_parameter"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "call_nowhere", "output": "1"}]},
     400, "input.1.call_id", "invalid_value"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAAAforeign"}]},
     400, "input.0.encrypted_content", "invalid_value"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id", "not_found"),
    ({"input": "x" * 300}, 400, "input", "invalid_value"),
    ({"input": "x", "model": "gpt-9"}, 404, "model", "model_not_found"),
]  # fmt: skip


@pytest.mark.parametrize("body,status,param,code", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_a_shaped_error_and_reaches_no_engine(body, status, param, code):
    r, fake = _post(body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert err["message"]
    assert fake.requests == []


def test_harmless_values_of_refused_fields_are_dropped():
    body = {"input": "x", "background": False, "conversation": None, "prompt": None,
            "context_management": [], "moderation": None, "include": [], "store": False,
            "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "k",
            "max_tool_calls": 3, "truncation": "disabled"}  # fmt: skip
    r, fake = _post(body)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "incomplete" and body["store"] is False
    assert (body["safety_identifier"], body["prompt_cache_key"]) == ("s", "k")


def test_an_expired_previous_response_is_404():
    now = [1000.0]
    store = ResponseStore(":memory:", 10, ttl_s=60.0, clock=lambda: now[0])
    r, _ = _post({"input": "x", "max_output_tokens": 3}, store=store)
    rid = r.json()["id"]
    r, _ = _post({}, path=f"/v1/responses/{rid}", store=store, method="GET")
    assert r.status_code == 200
    now[0] += 61
    r, fake = _post({"input": "y", "previous_response_id": rid}, store=store)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    r, _ = _post({}, path=f"/v1/responses/{rid}", store=store, method="GET")
    assert r.status_code == 404


def test_cancel_is_refused_for_a_response_that_exists_and_404_otherwise():
    store = ResponseStore(":memory:", 10, None)
    r, _ = _post({"input": "x"}, store=store)
    rid = r.json()["id"]
    r, _ = _post({}, path=f"/v1/responses/{rid}/cancel", store=store)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    r, _ = _post({}, path="/v1/responses/resp_x/cancel", store=store)
    assert r.status_code == 404
