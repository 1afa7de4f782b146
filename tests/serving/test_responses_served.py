"""/v1/responses on the real engine (tiny checkpoint, uvicorn, the openai SDK): a three-turn
conversation by `previous_response_id` whose prefix-cache hits show in usage, streaming
that equals the non-streamed answer token for token under greedy sampling, and no KV
block left held."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from appliance.config import ServerConfig
from tests.support.served_stack import Stack, served, tiny_engine, wait_idle_and_free
from tests.support.waiting import HANG_S

BLOCK = 16


@pytest.fixture(scope="module")
def stack(tiny_llama_dir) -> Iterator[Stack]:
    llm = tiny_engine(tiny_llama_dir, max_model_len=512, block_size=BLOCK, num_kv_blocks=128)
    with served(llm, ServerConfig(host="127.0.0.1", http_port=0)) as s:
        yield s


@pytest.fixture()
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)


def test_three_turns_by_previous_response_id_hit_the_prefix_cache(stack, client):
    kw = dict(model="tiny", temperature=0, max_output_tokens=8)
    r1 = client.responses.create(input="The capital of France is Paris.", **kw)
    r2 = client.responses.create(input="Tell me a story.", previous_response_id=r1.id, **kw)
    r3 = client.responses.create(input="One more.", previous_response_id=r2.id, **kw)
    u1, u2, u3 = r1.usage, r2.usage, r3.usage
    assert u1.input_tokens_details.cached_tokens == 0
    # each turn's prompt starts with the whole previous prompt: at least its full blocks hit
    for prev, cur in ((u1, u2), (u2, u3)):
        cached = cur.input_tokens_details.cached_tokens
        assert cached % BLOCK == 0
        assert BLOCK * (prev.input_tokens // BLOCK) <= cached < cur.input_tokens
        assert cur.input_tokens > prev.input_tokens + prev.output_tokens
    items = client.responses.input_items.list(r3.id, order="asc", limit=100).data
    assert [i.type for i in items] == ["message"] * 5
    assert [i.id for i in items[:2]] == [
        client.responses.input_items.list(r1.id).data[0].id, r1.output[0].id,
    ]  # fmt: skip
    wait_idle_and_free(stack.aeng)


def test_stream_equals_create_under_greedy_sampling(stack, client):
    kw = dict(model="tiny", input="Hello, how are you today?", temperature=0,
              max_output_tokens=12, extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert whole.status == final.status == "incomplete"
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens == 12
    wait_idle_and_free(stack.aeng)


def test_input_over_the_context_is_a_400_naming_input(stack, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="word " * 600)
    assert e.value.body["param"] == "input" and e.value.body["code"] == "context_length_exceeded"
    wait_idle_and_free(stack.aeng)


def test_logprobs_come_per_token_on_the_text_and_its_deltas(stack, client):
    kw = dict(model="tiny", input="Hello", temperature=0, max_output_tokens=6, top_logprobs=2,
              include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})  # fmt: skip
    r = client.responses.create(**kw)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens == 6
    assert "".join(lp.token for lp in lps) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    # greedy: the chosen token is the most likely one
    assert all(lp.top_logprobs[0].token == lp.token for lp in lps)
    events = list(client.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    # the same tokens; the values within float noise (the second run hits the prefix cache)
    assert [lp.token for lp in streamed] == [lp.token for lp in lps]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in lps], abs=1e-4)
    wait_idle_and_free(stack.aeng)


def test_a_stream_the_client_leaves_is_aborted_and_not_stored(stack):
    body = {"model": "tiny", "input": "Tell me a long story.", "max_output_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    rid = None
    with httpx.Client(timeout=HANG_S) as http:
        with http.stream("POST", f"{stack.url}/v1/responses", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"response.output_text.delta"' in line:
                    rid = json.loads(line[6:])["item_id"]
                    break
                if line.startswith("data: ") and '"response.created"' in line:
                    created = json.loads(line[6:])["response"]["id"]
    assert rid is not None
    wait_idle_and_free(stack.aeng)  # aborted in the engine, every KV block back
    assert httpx.get(f"{stack.url}/v1/responses/{created}", timeout=HANG_S).status_code == 404
