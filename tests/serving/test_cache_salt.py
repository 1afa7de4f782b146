"""Prefix-cache isolation over HTTP, native gRPC and KServe (`cache_salt`, and salting by
API key with `server.cache_salt_by_api_key`).

`cached_tokens` must not tell one client what another asked: a prompt sent under a salt (or
an API key) is served from the cache only to requests under the same salt and key. Each
test sends a prompt of three full KV blocks twice, the second time after the first
finished, and reads how many prompt tokens came from the cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from appliance.config import ServerConfig
from appliance.grpc.kserve_tensors import encode_bytes
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb
from appliance.grpc.proto.inference import grpc_service_pb2_grpc as kpb_grpc
from appliance.tenancy import api_key_salt, request_cache_salt
from tests.support.served_stack import Stack, served, tiny_engine

BLOCK = 16
KEY_A, KEY_B = "key-a", "key-b"
_prompts = itertools.count(1)


def _fresh_prompt() -> list[int]:
    """Three full blocks no other test sent (token ids, so the count is exact)."""
    base = 10 + 3 * BLOCK * next(_prompts)
    return list(range(base, base + 3 * BLOCK))


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    server = ServerConfig(
        host="127.0.0.1", http_port=0, api_keys=(KEY_A, KEY_B), cache_salt_by_api_key=True
    )
    llm = tiny_engine(tiny_llama_dir, block_size=BLOCK, max_model_len=512, num_kv_blocks=64)
    with served(llm, server) as s:
        yield s


def _http_cached(stack: Stack, route: str, prompt: list[int], key: str, salt: str | None) -> int:
    body: dict = {"max_tokens": 1}
    if route == "/v1/completions":
        body["prompt"] = prompt
    else:  # the chat template adds its own tokens around the content: the same both times
        body["messages"] = [{"role": "user", "content": " ".join(map(str, prompt))}]
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(
        f"{stack.url}{route}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _native_cached(stack: Stack, prompt: list[int], key: str, salt: str | None) -> int:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=1)
    )
    if salt is not None:
        req.cache_salt = salt

    async def main() -> int:
        async with stack.grpc.channel() as ch:
            call = pb_grpc.ApplianceStub(ch).Generate(
                req, metadata=(("authorization", f"Bearer {key}"),)
            )
            return [r async for r in call][-1].usage.cached_tokens

    return stack.grpc.run(main())


def _kserve_cached(stack: Stack, text: str, key: str, salt: str | None) -> int:
    """Prompt tokens the engine served from the cache for this one request."""
    req = kpb.ModelInferRequest(model_name="tiny", id="1")
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    req.raw_input_contents.append(encode_bytes([text.encode()]))
    req.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    req.raw_input_contents.append(encode_bytes([b'{"max_tokens": 1}']))
    if salt is not None:
        req.parameters["cache_salt"].string_param = salt
    kv = stack.aeng.engine.kv_manager
    before = kv.stats().prefix_hits

    async def main() -> None:
        async with stack.grpc.channel() as ch:
            await kpb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(
                req, metadata=(("authorization", f"Bearer {key}"),)
            )

    stack.grpc.run(main())
    return kv.stats().prefix_hits - before


def _send(stack: Stack, via: str):
    if via == "kserve":
        text = " ".join(map(str, _fresh_prompt()))
        return lambda key, salt: _kserve_cached(stack, text, key, salt)
    prompt = _fresh_prompt()
    if via == "grpc":
        return lambda key, salt: _native_cached(stack, prompt, key, salt)
    return lambda key, salt: _http_cached(stack, via, prompt, key, salt)


VIA = ["/v1/completions", "/v1/chat/completions", "grpc", "kserve"]


@pytest.mark.parametrize("via", VIA)
def test_same_salt_shares_the_cache_a_different_salt_does_not(stack, via):
    send = _send(stack, via)
    assert send(KEY_A, "tenant-1") == 0
    assert send(KEY_A, "tenant-2") == 0  # same prompt, same key, another salt: no hit
    assert send(KEY_A, None) == 0  # nor without one
    assert send(KEY_A, "tenant-1") >= 2 * BLOCK  # the first salt again: its blocks


@pytest.mark.parametrize("via", VIA)
def test_salting_by_api_key_keeps_keys_apart_and_a_key_shares_with_itself(stack, via):
    send = _send(stack, via)
    assert send(KEY_A, None) == 0
    assert send(KEY_B, None) == 0  # another key: no hit
    # Nor can key B reach key A's entries by sending key A's salt as its own.
    assert send(KEY_B, api_key_salt(KEY_A)) == 0
    assert send(KEY_A, None) >= 2 * BLOCK


def test_an_empty_salt_is_refused_naming_the_field(stack):
    r = httpx.post(
        f"{stack.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": ""},
        headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60,
    )  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text

    async def main() -> grpc.StatusCode:
        req = pb.GenerateRequest(text="hi", cache_salt="")
        async with stack.grpc.channel() as ch:
            call = pb_grpc.ApplianceStub(ch).Generate(
                req, metadata=(("authorization", f"Bearer {KEY_A}"),)
            )
            try:
                [r async for r in call]
            except grpc.aio.AioRpcError as e:
                assert e.details().startswith("cache_salt:"), e.details()
                return e.code()
        return grpc.StatusCode.OK

    assert stack.grpc.run(main()) == grpc.StatusCode.INVALID_ARGUMENT


def test_the_salt_holds_a_hash_of_the_key_never_the_key():
    salt = request_cache_salt("mine", KEY_A, by_api_key=True)
    assert salt == (api_key_salt(KEY_A), "mine") and KEY_A not in salt[0]
    assert request_cache_salt("mine", KEY_A, by_api_key=False) == ("mine",)
    assert request_cache_salt(None, None, by_api_key=False) == ()
