"""Work that grows with the input runs off the event loop, on every route and rpc.

All HTTP traffic shares one event loop (and all gRPC traffic another): a large input
tokenized, rendered or detokenized on it stalls every other stream. The one rule is
`AsyncEngine.offload_if_large` with `server.offload_prompt_chars`, and what it is given
must be the input's real size: every text part of a chat message, each message (however
empty), the number of ids to detokenize.

Structural, never timed: the tokenizer's methods are wrapped to record whether they ran
on a thread with a running event loop. The threshold is set low so that small inputs are
"large".
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from tests.support.served_stack import Stack, served, tiny_engine
from tests.support.waiting import HANG_S

THRESHOLD = 16  # the prompts must still fit the tiny context (128)


class Where:
    """Records, per tokenizer method call, whether it ran on an event loop's thread."""

    def __init__(self, tok: object):
        self.calls: list[tuple[str, bool]] = []
        for name in ("encode", "decode", "apply_chat_template"):
            self._wrap(tok, name)

    def _wrap(self, tok: object, name: str) -> None:
        fn = getattr(tok, name)

        def recorded(*args, **kw):
            self.calls.append((name, _on_event_loop()))
            return fn(*args, **kw)

        setattr(tok, name, recorded)

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
    with served(tiny_engine(tiny_llama_dir)) as s:
        s.aeng.offload_prompt_chars = THRESHOLD
        yield s, Where(s.aeng.tokenizer)


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
