"""Embeddings served: HTTP /v1/embeddings (the official openai client), native gRPC `Embed`
and KServe's ModelInfer (tritonclient), one real engine on a tiny sentence-transformers
checkpoint behind all three, each answer equal to sentence-transformers' (atol 1e-4 in
float32, and in norm); then the bad inputs, each a shaped 400 / INVALID_ARGUMENT naming the
field, and each model refusing the other task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
import tritonclient.grpc as grpcclient

from appliance.config import ServerConfig
from appliance.embeddings import from_base64
from appliance.grpc.errors import field_violation
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.http.app import build_app
from appliance.http.server import BackgroundServer
from engine.async_engine import AsyncEngine
from tests.support.fake_engine import FakeLLMEngine
from tests.support.grpc_harness import Harness, start_harness, tiny_llm_engine
from tests.support.tiny_embedders import st_encode, st_pooled_unnormalized

TEXTS = ["The capital of France is Paris.", "a", "Once upon a time there was a little girl."]
ATOL = 1e-4
MAX_MODEL_LEN = 64


@dataclass
class Served:
    model_dir: Path
    url: str
    harness: Harness
    client: openai.OpenAI

    @property
    def aeng(self) -> AsyncEngine:
        return self.harness.engine


@pytest.fixture(scope="module")
def served(tiny_embedder) -> Iterator[Served]:
    model_dir = tiny_embedder("qwen3", "mean", matryoshka=True)
    llm_engine = tiny_llm_engine(
        model_dir,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=16,
        max_queue_len=8,
        served_model_name="emb",
    )
    h = start_harness(llm_engine)
    app = build_app(h.engine, ServerConfig())
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        yield Served(model_dir, srv.url, h, client)
    h.close()


def _close(v: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(v, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(v.norm(dim=-1), ref.norm(dim=-1), atol=ATOL, rtol=0)


# ---- HTTP -----------------------------------------------------------------------------------
def test_openai_client_embeddings_equal_sentence_transformers(served):
    ref = st_encode(served.model_dir, TEXTS)
    r = served.client.embeddings.create(model="emb", input=TEXTS)  # the SDK asks for base64
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "emb"
    _close(torch.tensor([d.embedding for d in r.data]), ref)
    tokens = sum(len(served.aeng.tokenizer.encode(t)) for t in TEXTS)
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (tokens, tokens)
    floats = served.client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    _close(torch.tensor([d.embedding for d in floats.data]), ref)


def test_base64_decodes_to_the_same_floats(served):
    body = {"input": TEXTS, "model": "emb"}
    as_float = httpx.post(f"{served.url}/v1/embeddings", json=body).json()
    as_b64 = httpx.post(
        f"{served.url}/v1/embeddings", json={**body, "encoding_format": "base64"}
    ).json()
    assert as_float["object"] == "list" and as_float["id"].startswith("embd-")
    for f, b in zip(as_float["data"], as_b64["data"], strict=True):
        assert isinstance(b["embedding"], str)
        assert from_base64(b["embedding"]) == f["embedding"]  # exactly: float32 both ways


def test_token_id_inputs_and_one_text_equal_the_batch(served):
    ids = [served.aeng.tokenizer.encode(t) for t in TEXTS]
    batch = served.client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    by_ids = served.client.embeddings.create(model="emb", input=ids, encoding_format="float")
    one = served.client.embeddings.create(model="emb", input=ids[2], encoding_format="float")
    single = served.client.embeddings.create(model="emb", input=TEXTS[2], encoding_format="float")
    want = [d.embedding for d in batch.data]
    assert [d.embedding for d in by_ids.data] == want
    assert one.data[0].embedding == single.data[0].embedding
    torch.testing.assert_close(torch.tensor(single.data[0].embedding), torch.tensor(want[2]),
                               atol=1e-5, rtol=0)  # fmt: skip


def test_dimensions_on_a_matryoshka_model_equal_the_truncated_reference(served):
    r = served.client.embeddings.create(model="emb", input=TEXTS, dimensions=16)
    ref = st_encode(served.model_dir, TEXTS, truncate_dim=16, normalize=True)
    _close(torch.tensor([d.embedding for d in r.data]), ref)


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"input": ""}, "input", "must not be empty"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["ok", ""]}, "input[1]", "must not be empty"),
        ({"input": [[]]}, "input", "must not be empty"),
        ({"input": ["ok", "word " * 80]}, "input[1]", "maximum context length is 64"),
        ({"input": list(range(5, 5 + MAX_MODEL_LEN + 1))}, "input", "maximum context length"),
        ({"input": "x", "dimensions": 65}, "dimensions", "at most 64"),
        ({"input": "x", "dimensions": 0}, "dimensions", "positive integer"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
        ({"input": [[1, 2], [100000]]}, "input[1]", "outside the vocabulary"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", ""),
        ({"input": "x", "messages": []}, "messages", ""),
        ({"input": ["x"] * 9}, "input", "at most 8 inputs"),
    ],
)
def test_bad_embedding_requests_are_shaped_400s(served, body, param, needle):
    r = httpx.post(f"{served.url}/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"]
    assert err["type"] == "invalid_request_error"
    if "maximum context length" in needle:
        assert err["code"] == "context_length_exceeded"


def test_unknown_model_is_404_and_generation_on_an_embedding_model_is_400(served):
    r = httpx.post(f"{served.url}/v1/embeddings", json={"input": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
        r = httpx.post(f"{served.url}{path}", json=body)
        assert r.status_code == 400, path
        err = r.json()["error"]
        assert err["param"] == "model" and "task 'embed'" in err["message"], path

    async def generate() -> None:
        async with served.harness.channel() as ch:
            async for _ in pb_grpc.ApplianceStub(ch).Generate(pb.GenerateRequest(text="hi")):
                pass

    with pytest.raises(grpc.aio.AioRpcError) as e:
        served.harness.run(generate())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "task 'embed'" in e.value.details()


def test_the_engine_keeps_serving_and_holds_no_kv_after_the_bad_requests(served):
    r = served.client.embeddings.create(model="emb", input=TEXTS[:1], encoding_format="float")
    assert len(r.data[0].embedding) == 64
    s = served.aeng.stats()
    assert s.num_free_blocks == s.num_blocks and s.num_running == s.num_waiting == 0


def test_embedding_metrics_count_inputs_and_their_tokens(served):
    served.client.embeddings.create(model="emb", input=TEXTS)
    text = httpx.get(f"{served.url}/metrics").text
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
             if ln and not ln.startswith("#")}  # fmt: skip
    assert lines['appliance_embedding_inputs_total{finish_reason="stop"}'] >= 3
    assert lines["appliance_embedding_prompt_tokens_total"] >= 3
    assert lines["appliance_request_inference_time_seconds_count"] >= 3
    assert lines['appliance_request_queue_time_seconds_count{tenant="default"}'] >= 3


def test_truncate_prompt_tokens_keeps_each_inputs_last_tokens(served):
    ids = served.aeng.tokenizer.encode(TEXTS[2])
    assert len(ids) > 4
    cut = served.client.embeddings.create(
        model="emb", input=TEXTS[2], encoding_format="float",
        extra_body={"truncate_prompt_tokens": 4},
    )  # fmt: skip
    tail = served.client.embeddings.create(model="emb", input=ids[-4:], encoding_format="float")
    whole = served.client.embeddings.create(model="emb", input=TEXTS[2], encoding_format="float")
    assert cut.usage.prompt_tokens == 4
    assert cut.data[0].embedding == tail.data[0].embedding != whole.data[0].embedding


# ---- every other architecture and pooling method through HTTP and gRPC --------------------
# The module's `served` model is qwen3 / mean; these are cases of tests/engine/test_embeddings.py
# (the same cached checkpoints), so every architecture and every pooling method is checked
# against sentence-transformers through the served routes too, not only offline.
SERVED_CASES = [("llama", "last", True, True), ("mistral", "cls", False, True),
                ("qwen2", "mean", False, False)]  # fmt: skip


@pytest.mark.parametrize(("arch", "pooling", "bare", "normalize"), SERVED_CASES)
def test_each_architecture_and_pooling_equals_sentence_transformers_over_http_and_grpc(
    tiny_embedder, arch, pooling, bare, normalize
):
    model_dir = tiny_embedder(arch, pooling, bare=bare, normalize=normalize)
    ref = st_encode(model_dir, TEXTS)
    other = "cls" if pooling != "cls" else "last"  # the check's power: another method is far
    unit = torch.nn.functional.normalize
    wrong = unit(st_pooled_unnormalized(model_dir, TEXTS, other), dim=1)
    assert (wrong - unit(ref, dim=1)).abs().max() > 100 * ATOL
    h = start_harness(tiny_llm_engine(model_dir, max_model_len=MAX_MODEL_LEN,
                                      max_num_batched_tokens=8, served_model_name="e"))  # fmt: skip
    try:
        with BackgroundServer(build_app(h.engine, ServerConfig())) as srv:
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
            r = client.embeddings.create(model="e", input=TEXTS)  # base64, as the SDK asks
        _close(torch.tensor([d.embedding for d in r.data]), ref)
        resp = _embed(h, pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in TEXTS]))
        _close(torch.tensor([list(e.values) for e in resp.embeddings]), ref)
    finally:
        h.close()
    asyncio.set_event_loop(None)


# ---- gRPC -----------------------------------------------------------------------------------
def _embed(h: Harness, request: pb.EmbedRequest) -> pb.EmbedResponse:
    async def call() -> pb.EmbedResponse:
        async with h.channel() as ch:
            return await pb_grpc.ApplianceStub(ch).Embed(request)

    return h.run(call())


def test_grpc_embed_equals_sentence_transformers(served):
    ids = served.aeng.tokenizer.encode(TEXTS[1])
    inputs = [pb.EmbedInput(text=TEXTS[0]), pb.EmbedInput(token_ids=pb.TokenIds(ids=ids)),
              pb.EmbedInput(text=TEXTS[2])]  # fmt: skip
    resp = _embed(served.harness, pb.EmbedRequest(inputs=inputs))
    got = torch.tensor([list(e.values) for e in resp.embeddings])
    _close(got, st_encode(served.model_dir, TEXTS))
    counts = [e.prompt_tokens for e in resp.embeddings]
    assert counts[1] == len(ids) and resp.usage.prompt_tokens == sum(counts)
    short = _embed(served.harness, pb.EmbedRequest(inputs=inputs[:1], dimensions=16))
    ref = st_encode(served.model_dir, TEXTS[:1], truncate_dim=16, normalize=True)
    _close(torch.tensor([list(short.embeddings[0].values)]), ref)


@pytest.mark.parametrize(
    ("request_kw", "field"),
    [
        ({"inputs": []}, "inputs"),
        ({"inputs": [pb.EmbedInput(text="ok"), pb.EmbedInput(text="")]}, "inputs[1].text"),
        ({"inputs": [pb.EmbedInput()]}, "inputs[0]"),
        ({"inputs": [pb.EmbedInput(text="x" * 400)]}, "inputs[0].text"),
        ({"inputs": [pb.EmbedInput(text="x")], "dimensions": 65}, "dimensions"),
        ({"inputs": [pb.EmbedInput(text="x")], "truncate_prompt_tokens": -2},
         "truncate_prompt_tokens"),
    ],
)  # fmt: skip
def test_grpc_embed_bad_input_is_invalid_argument_naming_the_field(served, request_kw, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _embed(served.harness, pb.EmbedRequest(**request_kw))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violation(err.value) == field
    assert err.value.details().startswith(f"{field}:")


def test_grpc_embed_unknown_model_is_not_found(served):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _embed(served.harness, pb.EmbedRequest(model="nope", inputs=[pb.EmbedInput(text="x")]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


# ---- KServe ---------------------------------------------------------------------------------
def test_kserve_infer_returns_the_embeddings_as_an_fp32_tensor(served):
    client = grpcclient.InferenceServerClient(url=served.harness.address)
    try:
        meta = client.get_model_metadata("emb")
        outs = {o.name: (o.datatype, list(o.shape)) for o in meta.outputs}
        assert outs["embedding"] == ("FP32", [-1, 64])
        t = grpcclient.InferInput("text_input", [len(TEXTS)], "BYTES")
        t.set_data_from_numpy(np.array([s.encode() for s in TEXTS], dtype=object))
        result = client.infer("emb", [t])
        emb = result.as_numpy("embedding")
        assert emb.dtype == np.float32 and emb.shape == (len(TEXTS), 64)
        _close(torch.from_numpy(emb.copy()), st_encode(served.model_dir, TEXTS))
        counts = result.as_numpy("num_input_tokens").tolist()
        assert counts == [len(served.aeng.tokenizer.encode(s)) for s in TEXTS]
        t_empty = grpcclient.InferInput("text_input", [1], "BYTES")
        t_empty.set_data_from_numpy(np.array([b""], dtype=object))
        from tritonclient.utils import InferenceServerException

        with pytest.raises(InferenceServerException, match="text_input: must not be empty"):
            client.infer("emb", [t_empty])
    finally:
        client.close()


# ---- a generation model asked for embeddings --------------------------------------------------
def test_a_generation_model_refuses_embeddings_on_http_and_grpc():
    fake = FakeLLMEngine()
    h = start_harness(fake, model_name="fake-model")
    try:
        with BackgroundServer(build_app(h.engine, ServerConfig())) as srv:
            r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "x"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "model" and "task 'generate'" in err["message"]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _embed(h, pb.EmbedRequest(inputs=[pb.EmbedInput(text="x")]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "task 'generate'" in e.value.details() and field_violation(e.value) == "model"
    finally:
        h.close()
    asyncio.set_event_loop(None)


# ---- spans ------------------------------------------------------------------------------------
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def test_each_embedding_input_is_an_embeddings_span_under_the_callers_trace(served):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from appliance.telemetry import TracingSettings, setup_tracing

    exporter = InMemorySpanExporter()
    tracing = setup_tracing(TracingSettings(otlp_endpoint="unused"), exporter=exporter)
    with BackgroundServer(build_app(served.aeng, ServerConfig(), tracing=tracing)) as srv:
        r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": TEXTS[:2]},
                       headers={"traceparent": TRACEPARENT})  # fmt: skip
    assert r.status_code == 200
    tracing.force_flush()
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.attributes["gen_ai.response.id"])
    assert [s.name for s in spans] == ["embeddings emb", "embeddings emb"]
    for s, text in zip(spans, TEXTS[:2], strict=True):
        a = s.attributes
        assert f"{s.context.trace_id:032x}" == TRACE_ID
        assert a["gen_ai.operation.name"] == "embeddings"
        assert a["gen_ai.usage.input_tokens"] == len(served.aeng.tokenizer.encode(text))
        assert a["gen_ai.embeddings.dimension.count"] == 64
        assert "gen_ai.usage.output_tokens" not in a and "gen_ai.request.temperature" not in a
        assert a["gen_ai.latency.time_in_queue"] >= 0 and a["gen_ai.latency.e2e"] > 0
    tracing.shutdown()
