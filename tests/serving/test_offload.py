"""Work that grows with the input runs off the event loop, on every route and rpc.

All HTTP traffic shares one event loop (and all gRPC traffic another): a large input
parsed, validated, rendered, tokenized, compiled or detokenized on it stalls every other
stream. The one rule is `AsyncEngine.offload_if_large` with `server.offload_prompt_chars`,
and what it is given must be the request's whole input: its body's bytes (HTTP) or its
message's (gRPC), so that many small prompts, one long tool description, many tools or a
large schema count as what they are, not prompt by prompt or message by message.

Structural, never timed: the tokenizer's methods, the JSON parser and request validation
of the HTTP bodies, the chat dialect (tools), KServe's request parser and the engine's
`prepare_request` are wrapped to record whether they ran on a thread with a running event
loop. The threshold is set low so that small inputs are "large".
"""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

import appliance.grpc.kserve as kserve_module
import appliance.grpc.native_chat as native_chat_module
import appliance.http.body as body_module
import appliance.http.chat as chat_module
from appliance.grpc.kserve_tensors import encode_bytes
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb
from appliance.grpc.proto.inference import grpc_service_pb2_grpc as kpb_grpc
from appliance.http.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from tests.support.served_stack import Stack, served, tiny_engine
from tests.support.waiting import HANG_S

THRESHOLD = 16  # small enough that every request below is "large"


class Where:
    """Records, per call of the wrapped functions, whether it ran on an event loop's thread."""

    def __init__(self, s: Stack):
        self.calls: list[tuple[str, bool]] = []
        tok = s.aeng.tokenizer
        for name in ("encode", "decode", "apply_chat_template"):
            self._wrap(tok, name)
        self._wrap(s.aeng.engine, "prepare_request")
        json_proxy = types.SimpleNamespace(**vars(json))
        body_module.json = json_proxy  # type: ignore[attr-defined]
        self._wrap(json_proxy, "loads", "json.loads")
        for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest):
            fn = model.model_validate
            model.model_validate = self._recorder("model_validate", fn)  # type: ignore[method-assign]
        self._wrap(chat_module, "chat_dialect")
        self._wrap(native_chat_module, "chat_dialect")
        self._wrap(kserve_module, "parse_request")

    def _recorder(self, name: str, fn):
        def recorded(*args, **kw):
            self.calls.append((name, _on_event_loop()))
            return fn(*args, **kw)

        return recorded

    def _wrap(self, obj: object, attr: str, name: str | None = None) -> None:
        setattr(obj, attr, self._recorder(name or attr, getattr(obj, attr)))

    def ran(self, name: str) -> list[bool]:
        """For each call of `name` since the last `clear`: did it run on the event loop."""
        return [on_loop for n, on_loop in self.calls if n == name]


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[tuple[Stack, Where]]:
    real_json = body_module.json
    originals = {
        m: m.model_validate for m in (CompletionRequest, ChatCompletionRequest, TokenizeRequest)
    }
    modules = {m: (m.chat_dialect) for m in (chat_module, native_chat_module)}
    parse_request = kserve_module.parse_request
    # Context 512: room for the tools the fallback prompt writes out.
    with served(tiny_engine(tiny_llama_dir, max_model_len=512)) as s:
        s.aeng.offload_prompt_chars = THRESHOLD
        try:
            yield s, Where(s)
        finally:
            body_module.json = real_json
            for m, fn in originals.items():
                m.model_validate = fn
            for m, fn in modules.items():
                m.chat_dialect = fn
            kserve_module.parse_request = parse_request


@pytest.fixture()
def where(stack) -> Where:
    stack[1].calls.clear()
    return stack[1]


def _post(s: Stack, path: str, body: dict) -> dict:
    r = httpx.post(f"{s.url}{path}", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    return r.json()


def _parts(n: int) -> list[dict]:
    return [{"type": "text", "text": "hi"} for _ in range(n)]


LARGE_CHATS = {
    "text parts": [{"role": "user", "content": _parts(THRESHOLD // 2)}],
    "many empty messages": [{"role": "user", "content": ""}] * (THRESHOLD + 1),
}


@pytest.mark.parametrize("messages", list(LARGE_CHATS.values()), ids=list(LARGE_CHATS))
def test_http_tokenize_renders_a_large_chat_off_the_loop(stack, where, messages) -> None:
    s, _ = stack
    _post(s, "/tokenize", {"messages": messages})
    assert where.ran("apply_chat_template") == [False]


def test_http_chat_renders_text_parts_off_the_loop(stack, where) -> None:
    s, _ = stack
    messages = LARGE_CHATS["text parts"]
    _post(s, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert where.ran("apply_chat_template") == [False]


def test_http_detokenize_decodes_many_ids_off_the_loop(stack, where) -> None:
    s, _ = stack
    _post(s, "/detokenize", {"tokens": [5] * (THRESHOLD + 1)})
    assert where.ran("decode") == [False]


def test_http_detokenize_still_names_an_id_outside_the_vocabulary(stack, where) -> None:
    s, _ = stack
    r = httpx.post(f"{s.url}/detokenize", json={"tokens": [5] * THRESHOLD + [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text


def _chat(n: int) -> pb.Chat:
    return pb.Chat(messages=[pb.ChatMessage(role="user", content="") for _ in range(n)])


def test_grpc_tokenize_renders_many_empty_messages_off_the_loop(stack, where) -> None:
    s, _ = stack

    async def call() -> None:
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            await pb_grpc.ApplianceStub(ch).Tokenize(pb.TokenizeRequest(chat=_chat(THRESHOLD)))

    s.run(call())
    assert where.ran("apply_chat_template") == [False]


def test_grpc_generate_renders_many_empty_messages_off_the_loop(stack, where) -> None:
    s, _ = stack

    async def call() -> None:
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            req = pb.GenerateRequest(
                chat=_chat(THRESHOLD), sampling=pb.SamplingParams(max_tokens=1)
            )
            async for _ in pb_grpc.ApplianceStub(ch).Generate(req):
                pass

    s.run(call())
    assert where.ran("apply_chat_template") == [False]


def test_grpc_detokenize_decodes_many_ids_off_the_loop(stack, where) -> None:
    s, _ = stack

    async def call() -> str:
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            req = pb.DetokenizeRequest(token_ids=[5] * (THRESHOLD + 1))
            return (await pb_grpc.ApplianceStub(ch).Detokenize(req)).text

    assert s.run(call())
    assert where.ran("decode") == [False]


def test_grpc_detokenize_still_names_an_id_outside_the_vocabulary(stack, where) -> None:
    s, _ = stack

    async def call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            req = pb.DetokenizeRequest(token_ids=[5] * THRESHOLD + [10**6])
            try:
                await pb_grpc.ApplianceStub(ch).Detokenize(req)
            except grpc.aio.AioRpcError as e:
                assert "token_ids" in (e.details() or "")
                return e.code()
        return grpc.StatusCode.OK

    assert s.run(call()) == grpc.StatusCode.INVALID_ARGUMENT


# ---- the request's whole input decides (issue 28, B7) --------------------------------------
MANY = [f"p{i}" for i in range(THRESHOLD)]  # each prompt far under the threshold
SHORT = [{"role": "user", "content": "hi"}]


def _tool(name: str = "get_weather", description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


LONG_TOOL = [_tool(description="Looks the weather up for a city, any city at all.")]
MANY_TOOLS = [_tool(f"t{i}") for i in range(2)]
BIG_SCHEMA = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
    "type": "object", "properties": {f"field_{i}": {"type": "boolean"} for i in range(8)}}}}  # fmt: skip
CHAT = ["json.loads", "model_validate", "chat_dialect", "apply_chat_template"]
HTTP_CASES = {
    "completions: many small prompts": (
        "/v1/completions", {"prompt": MANY, "max_tokens": 1},
        ["json.loads", "model_validate", "encode", "prepare_request"]),
    "completions render: many small prompts": (
        "/v1/completions/render", {"prompt": MANY}, ["json.loads", "model_validate", "encode"]),
    "chat: one long tool description": (
        "/v1/chat/completions", {"messages": SHORT, "tools": LONG_TOOL, "max_tokens": 1},
        [*CHAT, "prepare_request"]),
    "chat: many tools": (
        "/v1/chat/completions", {"messages": SHORT, "tools": MANY_TOOLS, "max_tokens": 1},
        [*CHAT, "prepare_request"]),
    "chat: a large schema": (
        "/v1/chat/completions", {"messages": SHORT, "response_format": BIG_SCHEMA, "max_tokens": 1},
        [*CHAT, "prepare_request"]),
    "chat render: one long tool description": (
        "/v1/chat/completions/render", {"messages": SHORT, "tools": LONG_TOOL}, CHAT),
    "tokenize: a prompt": ("/tokenize", {"prompt": "x" * (THRESHOLD + 1)},
                           ["json.loads", "model_validate", "encode"]),
}  # fmt: skip


@pytest.mark.parametrize("path, body, names", list(HTTP_CASES.values()), ids=list(HTTP_CASES))
def test_http_work_proportional_to_the_whole_body_runs_off_the_loop(
    stack, where, path, body, names
) -> None:
    s, _ = stack
    _post(s, path, body)
    for name in names:
        ran = where.ran(name)
        assert ran and not any(ran), (name, ran)


def _grpc(s: Stack, call) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            await call(ch)

    s.run(main())


async def _drain(it) -> None:
    async for _ in it:
        pass


def _pb_tool(description: str) -> pb.Tool:
    return pb.Tool(name="get_weather", description=description,
                   parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))  # fmt: skip


def test_grpc_generate_with_a_long_tool_description_runs_off_the_loop(stack, where) -> None:
    s, _ = stack
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")],
                   tools=[_pb_tool("Looks the weather up for a city, any city at all.")])  # fmt: skip
    req = pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=1))
    _grpc(s, lambda ch: _drain(pb_grpc.ApplianceStub(ch).Generate(req)))
    for name in ("chat_dialect", "apply_chat_template", "prepare_request"):
        ran = where.ran(name)
        assert ran and not any(ran), (name, ran)


def test_grpc_generate_with_a_schema_compiles_off_the_loop(stack, where) -> None:
    s, _ = stack
    schema = json.dumps(BIG_SCHEMA["json_schema"]["schema"])
    req = pb.GenerateRequest(
        text="hi", sampling=pb.SamplingParams(max_tokens=1, json_schema=schema)
    )
    _grpc(s, lambda ch: _drain(pb_grpc.ApplianceStub(ch).Generate(req)))
    assert where.ran("prepare_request") == [False]


def test_kserve_parses_and_prepares_off_the_loop(stack, where) -> None:
    s, _ = stack
    sampling = {"max_tokens": 1, "guided_json": BIG_SCHEMA["json_schema"]["schema"]}
    req = kpb.ModelInferRequest(model_name="tiny", id="1")
    for name, value in (
        ("text_input", b"hi"),
        ("sampling_parameters", json.dumps(sampling).encode()),
    ):
        req.inputs.add(name=name, datatype="BYTES", shape=[1])
        req.raw_input_contents.append(encode_bytes([value]))
    _grpc(s, lambda ch: kpb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req))
    assert where.ran("parse_request") == [False]
    assert where.ran("prepare_request") == [False]


def test_grpc_tokenize_text_runs_off_the_loop(stack, where) -> None:
    s, _ = stack
    req = pb.TokenizeRequest(text="x" * (THRESHOLD + 1))
    _grpc(s, lambda ch: pb_grpc.ApplianceStub(ch).Tokenize(req))
    assert where.ran("encode") == [False]
