"""The real thing: uvicorn on 127.0.0.1, the real engine on the tiny checkpoint, the official
`openai` client. One server per module; few tokens per request, so the module stays fast.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import ServerConfig
from appliance.http.app import build_app
from appliance.http.server import BackgroundServer
from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from engine.request_stream import RequestStream
from tests.support.waiting import HANG_S, StepGate, wait_for

MAX_MODEL_LEN = 128
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Served:
    url: str
    aeng: AsyncEngine
    client: openai.OpenAI


def _engine(model_dir, **sched) -> AsyncEngine:
    cfg = EngineConfig(
        model=ModelConfig(path=str(model_dir), served_name="tiny", max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_kv_blocks=64),
        scheduler=SchedulerConfig(**{"max_num_seqs": 8, "max_n": 4, **sched}),
        runtime=RuntimeConfig(device="cpu", num_threads=1),
    )
    return AsyncEngine.from_config(cfg)


@pytest.fixture(scope="module")
def served(tiny_llama_dir) -> Iterator[Served]:
    aeng = _engine(tiny_llama_dir)
    with BackgroundServer(build_app(aeng, ServerConfig())) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        yield Served(srv.url, aeng, client)
    _shutdown(aeng)


def _shutdown(aeng: AsyncEngine) -> None:
    import asyncio

    asyncio.run(aeng.shutdown())


def _wait_idle(aeng: AsyncEngine) -> None:
    def idle() -> bool:
        s = aeng.stats()
        return aeng.num_in_flight == 0 and s.num_running == 0 and s.num_waiting == 0

    wait_for(idle, f"engine idle ({aeng.stats()})")


def test_models_lists_the_served_name(served):
    assert [m.id for m in served.client.models.list().data] == ["tiny"]


def test_chat_non_streamed_has_content_and_usage(served):
    r = served.client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=5, temperature=0
    )
    assert r.object == "chat.completion" and r.model == "tiny"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    tok = httpx.post(f"{served.url}/tokenize", json={"messages": MSGS}).json()
    assert r.usage.prompt_tokens == tok["count"]
    assert 1 <= r.usage.completion_tokens <= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streamed_equals_non_streamed_and_ends_with_usage(served):
    kw = dict(
        model="tiny", messages=MSGS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = served.client.chat.completions.create(**kw)
    chunks = list(
        served.client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(served, route):
    kw = dict(
        model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    if route == "chat":
        chunks = list(served.client.chat.completions.create(messages=MSGS, **kw))
        prompt = httpx.post(f"{served.url}/tokenize", json={"messages": MSGS}).json()["count"]
    else:
        chunks = list(served.client.completions.create(prompt="Once upon a time", **kw))
        prompt = httpx.post(f"{served.url}/tokenize", json={"prompt": "Once upon a time"})
        prompt = prompt.json()["count"]
    assert all(c.usage is not None for c in chunks), [c.usage for c in chunks]
    assert {c.usage.prompt_tokens for c in chunks} == {prompt}
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 6
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].usage.completion_tokens == 6
    if route == "chat":  # the role chunk comes before any token
        assert chunks[0].choices[0].delta.role == "assistant" and done[0] == 0


def test_completions_streamed_equals_non_streamed(served):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    whole = served.client.completions.create(**kw, extra_body={"ignore_eos": True})
    parts = list(
        served.client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"


def test_n2_returns_two_indexed_choices(served):
    r = served.client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=4, n=2, seed=7, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 8


def test_chat_logprobs_have_top_alternatives(served):
    r = served.client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for lp in content:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[-1].logprob
        assert abs(lp.top_logprobs[0].logprob - lp.logprob) < 1e-4  # greedy picks the top
    assert "".join(lp.token for lp in content) == r.choices[0].message.content


def test_completion_logprobs_legacy_format(served):
    r = served.client.completions.create(
        model="tiny", prompt="The dragon", max_tokens=3, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0
    # Keyed by token text, so two ids that decode alike share a key.
    assert all(
        tok in top and 1 <= len(top) <= 2
        for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True)
    )


def test_streamed_completion_logprobs_equal_the_non_streamed_ones(served):
    kw = dict(model="tiny", prompt="The dragon", max_tokens=6, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})  # fmt: skip
    whole = served.client.completions.create(**kw).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in served.client.completions.create(**kw, stream=True)
             if c.choices and c.choices[0].logprobs]  # fmt: skip
    assert [t for p in parts for t in p.tokens] == whole.tokens
    assert [x for p in parts for x in p.token_logprobs] == whole.token_logprobs
    assert [x for p in parts for x in p.top_logprobs] == whole.top_logprobs
    # Offsets follow the text actually sent, which depends on how steps fall into chunks
    # (a detokenizer holding back a partial character, a server merging two steps): only
    # their count is fixed.
    assert len([x for p in parts for x in p.text_offset]) == len(whole.text_offset)


def test_stop_string_cuts_the_output_before_it(served):
    kw = dict(model="tiny", prompt="Hello, how are", max_tokens=16, temperature=0)
    full = served.client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"degenerate output {full!r}"
    cut = served.client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_same_seed_same_sample(served):
    kw = dict(model="tiny", prompt="The weather", max_tokens=8, temperature=1.0, seed=1234)
    a = served.client.completions.create(**kw).choices[0].text
    b = served.client.completions.create(**kw).choices[0].text
    assert a == b


def test_tokenize_detokenize_round_trip(served):
    toks = httpx.post(f"{served.url}/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert toks["count"] == len(toks["tokens"]) and toks["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(f"{served.url}/detokenize", json={"tokens": toks["tokens"]}).json()
    assert back["prompt"] == "The quick brown fox"


def test_disconnect_mid_stream_frees_the_requests_blocks(served):
    _wait_idle(served.aeng)
    body = {"prompt": "Once upon a time", "max_tokens": 100, "stream": True, "ignore_eos": True}
    gate = StepGate(served.aeng.engine, permits=1)  # prefill, then held: it cannot finish
    try:
        with (
            httpx.Client(timeout=HANG_S) as c,
            c.stream("POST", f"{served.url}/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            gate.wait_steps(1)
            wait_for(lambda: served.aeng.stats().kv_usage > 0, "the request holding blocks")
        _wait_idle(served.aeng)  # still held: the abort alone frees the blocks
        assert served.aeng.stats().kv_usage == 0
    finally:
        gate.remove()


ENGINE_BAD_INPUT = [
    ("prompt too long", "/v1/completions", {"prompt": "one two " * 200}, "prompt", "context_length_exceeded"),
    ("max_tokens beyond context", "/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens", "context_length_exceeded"),
    ("chat max_completion_tokens beyond context", "/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 1000}, "max_completion_tokens", "context_length_exceeded"),
    ("n beyond max_n", "/v1/completions", {"prompt": "hi", "n": 5}, "n", None),
    ("logit_bias outside vocab", "/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 5}}, "logit_bias", None),
    ("prompt token outside vocab", "/v1/completions", {"prompt": [1, 100000]}, "prompt", None),
    ("stop_token_ids outside vocab", "/v1/completions", {"prompt": "hi", "stop_token_ids": [100000]}, "stop_token_ids", None),
    ("empty prompt", "/v1/completions", {"prompt": ""}, "prompt", None),
    ("min_tokens above max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens", None),
]  # fmt: skip


@pytest.mark.parametrize(
    "path, body, param, code",
    [c[1:] for c in ENGINE_BAD_INPUT],
    ids=[c[0] for c in ENGINE_BAD_INPUT],
)
def test_engine_rejections_are_400_naming_the_field(served, path, body, param, code):
    r = httpx.post(f"{served.url}{path}", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    if code:
        assert err["code"] == code


def test_bad_requests_do_not_disturb_a_stream_in_flight(served):
    kw = dict(
        model="tiny",
        prompt="A journey of",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    expected = served.client.completions.create(**kw).choices[0].text
    with StepGate(served.aeng.engine, permits=1) as gate:  # one step, then held
        stream = served.client.completions.create(**kw, stream=True)
        gate.wait_steps(1)
        for _, path, body, _, _ in ENGINE_BAD_INPUT[:4]:
            assert httpx.post(f"{served.url}{path}", json=body).status_code == 400
        with pytest.raises(openai.NotFoundError):
            served.client.completions.create(model="nope", prompt="x")
        assert served.aeng.num_in_flight == 1  # the stream outlasted the bad requests
        gate.open()
        got = [p.choices[0].text for p in stream if p.choices]
    assert "".join(got) == expected


def test_openai_client_maps_errors(served):
    with pytest.raises(openai.BadRequestError) as ei:
        served.client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=0)
    assert ei.value.body["param"] == "max_tokens"


def test_metrics_after_traffic_parse_with_prometheus_parser(served):
    served.client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    text = httpx.get(f"{served.url}/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["appliance_prompt_tokens"].samples[0].value > 0
    assert fams["appliance_generation_tokens"].samples[0].value > 0
    assert fams["appliance_kv_cache_blocks"].samples[0].value == 64
    ttft = [
        s
        for s in fams["appliance_time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert ttft[0].value > 0
    assert "appliance_prefix_cache_hits" in fams and "appliance_preemptions" in fams


def test_api_keys_with_the_openai_client(served):
    app = build_app(served.aeng, ServerConfig(api_keys=("sk-test",)))
    with BackgroundServer(app) as srv:
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-test", max_retries=0)
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=1).choices
        bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_queue_full_is_429_with_the_real_engine(tiny_llama_dir):
    aeng = _engine(tiny_llama_dir, max_num_seqs=1, max_queue_len=1)
    gate = StepGate(aeng.engine, permits=1)  # the first request runs, then steps are held
    try:
        with BackgroundServer(build_app(aeng)) as srv:
            body = {"prompt": "hi", "max_tokens": 60, "ignore_eos": True, "stream": True}
            with httpx.Client(timeout=HANG_S) as c:
                with c.stream("POST", f"{srv.url}/v1/completions", json=body) as running:
                    assert running.status_code == 200
                    gate.wait_steps(1)
                    with c.stream("POST", f"{srv.url}/v1/completions", json=body) as waiting:
                        assert waiting.status_code == 200
                        r = c.post(
                            f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}
                        )
                        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            gate.open()
            _wait_idle(aeng)
            assert aeng.stats().kv_usage == 0
    finally:
        _shutdown(aeng)


def test_stream_sends_each_finish_reason_once(served, monkeypatch):
    """Choices finishing at different steps: each index gets exactly one finish_reason."""
    # Stopping on half the vocabulary at temperature 1 makes the four samples end at
    # different steps (seeded, so the run is the same every time). The engine steps in lock
    # step with the server: a step runs only once the server has taken the previous step's
    # output, so no two steps are merged into one chunk, however fast or slow either side.
    gate = StepGate(served.aeng.engine, permits=1)
    take = RequestStream.__anext__

    async def paced(self: RequestStream):
        out = await take(self)
        gate.allow(1)
        return out

    monkeypatch.setattr(RequestStream, "__anext__", paced)
    stops = list(range(0, 512, 2))
    try:
        chunks = list(
            served.client.completions.create(
                model="tiny", prompt="Once upon a time", max_tokens=12, n=4, temperature=1.0,
                seed=3, stream=True, extra_body={"stop_token_ids": stops},
            )
        )  # fmt: skip
    finally:
        gate.remove()
    finishes: dict[int, list[str]] = {}
    for ch in chunks:
        for c in ch.choices:
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    assert sorted(finishes) == [0, 1, 2, 3]
    assert all(len(v) == 1 for v in finishes.values()), finishes
    last_chunk_of = {}
    for i, ch in enumerate(chunks):
        for c in ch.choices:
            last_chunk_of[c.index] = i
    assert len(set(last_chunk_of.values())) > 1  # they really did finish apart
