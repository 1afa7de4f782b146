"""LoRA adapters served for real: the tiny checkpoint with tiny random PEFT adapters
(tests.support.tiny_lora), one engine behind HTTP (the `openai` client) and gRPC (native and
KServe), API keys on. Every answer with an adapter is compared with the offline engine's
greedy output for the same adapter and prompt, and with the base model's, so a request
that silently ran the base model (or another adapter) fails.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from appliance.config import ServerConfig
from appliance.config.schema import LoRASection
from appliance.grpc.kserve_tensors import decode_bytes
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb
from appliance.grpc.proto.inference import grpc_service_pb2_grpc as kpb_grpc
from engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
)
from engine.lora_request import LoRARequest
from engine.sampling_params import SamplingParams
from tests.serving.test_bad_input_grpc import _kserve, _sp
from tests.support.offline import run_to_finals
from tests.support.served_stack import Stack, start_stack, wait_idle_and_free
from tests.support.tiny_lora import make_tiny_adapter
from tests.support.waiting import HANG_S, StepGate, wait_for

KEY = "sk-adapters"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"
MAX_TOKENS = 6
LORA = LoRAConfig(enabled=True, max_loras=2, max_lora_rank=8)


def _engine(model_dir: Path) -> Any:
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=ModelConfig(
                path=str(model_dir), served_name="tiny", max_model_len=128, dtype="float32"
            ),
            cache=CacheConfig(block_size=16, num_kv_blocks=256),
            scheduler=SchedulerConfig(max_num_seqs=16, max_n=4),
            runtime=RuntimeConfig(device="cpu", num_threads=1),
            lora=LORA,
        )
    )


@dataclass
class Served:
    stack: Stack
    client: openai.OpenAI
    adapters_dir: Path  # lora.allowed_dirs
    dirs: dict[str, Path]  # adapter name -> directory (a is loaded at start)
    offline: Any  # an LLMEngine with the same config, never served

    def expect(self, prompt: str | list[int], adapter: str | None) -> str:
        """The offline engine's greedy text for `prompt` with `adapter` (None: the base)."""
        lora = None
        if adapter is not None:
            ids = {"a": 1, "b": 2, "c": 3}
            lora = LoRARequest(adapter, ids[adapter], str(self.dirs[adapter]))
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        self.offline.add_request("x", prompt, params, lora_request=lora)
        return run_to_finals(self.offline)["x"].outputs[0].text

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.stack.url}{path}", json=body, headers=AUTH, timeout=HANG_S)


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("adapters")
    dirs = {
        name: make_tiny_adapter(tiny_llama_dir, root / name, r=4, seed=seed)
        for name, seed in (("a", 1), ("b", 2), ("c", 3))
    }
    lora = LoRASection(
        enabled=True, max_loras=LORA.max_loras, max_lora_rank=LORA.max_lora_rank,
        modules={"a": str(dirs["a"])}, allow_runtime_updates=True, allowed_dirs=(str(root),),
    )  # fmt: skip
    stack = start_stack(
        _engine(tiny_llama_dir), ServerConfig(host="127.0.0.1", http_port=0, api_keys=(KEY,)),
        lora=lora,
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0)
    try:
        yield Served(stack, client, root, dirs, _engine(tiny_llama_dir))
    finally:
        stack.close()
    wait_idle_and_free(stack.aeng)


def _complete(s: Served, model: str) -> Any:
    return s.client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


# ---- HTTP ---------------------------------------------------------------------------------------
def test_model_field_runs_the_adapter_as_the_offline_engine_does(served) -> None:
    base, with_a = served.expect(PROMPT, None), served.expect(PROMPT, "a")
    assert with_a != base  # the adapter changes the output, so equality below means something
    r = _complete(served, "a")
    assert r.model == "a" and r.choices[0].text == with_a
    assert _complete(served, "tiny").choices[0].text == base

    messages = [{"role": "user", "content": "Name a city."}]
    ids = served.post("/tokenize", {"model": "a", "messages": messages}).json()["tokens"]
    chat = served.client.chat.completions.create(
        model="a", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.model == "a" and chat.choices[0].message.content == served.expect(ids, "a")

    chunks = served.client.completions.create(
        model="a", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == with_a


def test_responses_model_field_runs_the_adapter_as_the_offline_engine_does(served) -> None:
    """/v1/responses takes an adapter's name as `model` (issue 29): the answer is the
    adapter's greedy text for the same rendered prompt, not the base model's."""
    messages = [{"role": "user", "content": "Name a city."}]
    ids = served.post("/tokenize", {"model": "a", "messages": messages}).json()["tokens"]
    with_a, base = served.expect(ids, "a"), served.expect(ids, None)
    assert with_a != base
    for model, want in (("a", with_a), ("tiny", base)):
        r = served.client.responses.create(
            model=model, input="Name a city.", max_output_tokens=MAX_TOKENS, temperature=0,
            store=False, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert r.model == model and r.output_text == want
        assert r.usage.input_tokens == len(ids)
    with pytest.raises(openai.NotFoundError) as info:
        served.client.responses.create(model="nope", input="x", store=False)
    assert info.value.code == "model_not_found"


def test_models_lists_the_adapters_under_the_base_model(served) -> None:
    cards = {m.id: m for m in served.client.models.list().data}
    assert cards["a"].parent == "tiny" and cards["a"].root == str(served.dirs["a"])
    assert cards["tiny"].parent is None


def test_unknown_adapter_is_a_404_model_not_found(served) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _complete(served, "nope")
    assert info.value.code == "model_not_found"


def test_load_use_unload_at_runtime_over_http(served) -> None:
    real = str(served.dirs["b"].resolve())
    r = served.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(served.dirs["b"])})
    assert r.status_code == 200, r.text
    card = next(m for m in served.client.models.list().data if m.id == "b")
    assert card.parent == "tiny" and card.root == real
    assert _complete(served, "b").choices[0].text == served.expect(PROMPT, "b")

    r = served.post("/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as info:
        _complete(served, "b")
    assert info.value.code == "model_not_found"
    assert "b" not in {lo.lora_name for lo in served.stack.aeng.list_loras()}


def test_a_bad_adapter_directory_is_a_400_naming_the_problem(served) -> None:
    big = make_tiny_adapter(served.offline.config.model.path, served.adapters_dir / "big", r=16)
    r = served.post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_path" and "max_lora_rank" in err["message"], err
    empty = served.adapters_dir / "empty"
    empty.mkdir()
    r = served.post("/v1/load_lora_adapter", {"lora_name": "empty", "lora_path": str(empty)})
    assert r.status_code == 400 and "adapter_config.json is missing" in r.json()["error"]["message"]
    names = {m.id for m in served.client.models.list().data}
    assert not {"big", "empty"} & names


def test_outside_the_allowed_dirs_is_a_403(served, tmp_path) -> None:
    r = served.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 403 and r.json()["error"]["code"] == "path_not_allowed"


def test_load_and_unload_need_the_api_key(served) -> None:
    body = {"lora_name": "b", "lora_path": str(served.dirs["b"])}
    r = httpx.post(f"{served.stack.url}/v1/load_lora_adapter", json=body, timeout=HANG_S)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "b" not in {m.id for m in served.client.models.list().data}


def test_concurrent_load_and_unload_while_streams_run_lose_no_request(served) -> None:
    """Streams on b (loaded at runtime), a and the base are held mid-generation; b is
    unloaded meanwhile and c loaded and unloaded twice. Every stream ends whole and equal to
    the offline engine's text; the unload of b answers only after b's last request finished."""
    aeng, llm = served.stack.aeng, served.stack.aeng.engine
    assert served.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(served.dirs["b"])}).status_code == 200  # fmt: skip
    finished: dict[str, float] = {}
    aeng.add_finish_listener(lambda f: finished.setdefault(f.request_id, time.monotonic()))
    models = ["b", "b", "b", "a", "a", "tiny"]

    def stream(model: str) -> tuple[str, str, str | None]:
        rid, text, reason = "", "", None
        for chunk in served.client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        ):  # fmt: skip
            rid = chunk.id
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return rid, text, reason

    unloaded_at: list[float] = []

    def unload_b() -> int:
        r = served.post("/v1/unload_lora_adapter", {"lora_name": "b"})
        unloaded_at.append(time.monotonic())
        return r.status_code

    # The gate is lifted before the pool waits for its threads, so a failure cannot hang.
    with ThreadPoolExecutor(len(models) + 1) as pool, StepGate(llm) as gate:
        futures = [pool.submit(stream, m) for m in models]
        wait_for(lambda: aeng.stats().num_waiting == len(models), "every stream queued")
        assert aeng.stats().lora_waiting == {"b": 3, "a": 2}
        gate.allow(2)  # prefill and one decode: every stream is mid-generation
        gate.wait_steps(2)
        unload = pool.submit(unload_b)
        wait_for(lambda: served.stack.grpc.adapters.get("b") is None, "b's unload started")
        with pytest.raises(openai.NotFoundError):  # b is no longer served to new requests
            _complete(served, "b")
        for _ in range(2):  # c comes and goes while b drains
            for path, body in (
                ("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(served.dirs["c"])}),
                ("/v1/unload_lora_adapter", {"lora_name": "c"}),
            ):
                assert served.post(path, body).status_code == 200
        assert not unload.done()  # b's requests cannot finish while the steps are held
        gate.open()
        results = [f.result(HANG_S) for f in futures]
        assert unload.result(HANG_S) == 200

    expected = {m: served.expect(PROMPT, None if m == "tiny" else m) for m in set(models)}
    for model, (_, text, reason) in zip(models, results, strict=True):
        assert (text, reason) == (expected[model], "length"), model
    b_ids = [rid for model, (rid, _, _) in zip(models, results, strict=True) if model == "b"]
    assert max(finished[rid] for rid in b_ids) <= unloaded_at[0]
    assert {m.id for m in served.client.models.list().data} == {"tiny", "a"}
    wait_idle_and_free(aeng)


def test_lora_metrics_count_requests_per_adapter(served) -> None:
    _complete(served, "a")
    text = httpx.get(f"{served.stack.url}/metrics", timeout=HANG_S).text
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    counts = {
        s.labels["adapter"]: s.value
        for s in fams["appliance_lora_requests"].samples
        if s.name.endswith("_total")
    }
    assert counts["a"] >= 1
    (info,) = fams["vllm:lora_requests_info"].samples
    assert info.labels["max_lora"] == "2" and info.value > 0


# ---- gRPC ---------------------------------------------------------------------------------------
async def _generate(s: Served, **fields: Any) -> str:
    request = pb.GenerateRequest(
        text=PROMPT,
        sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        **fields,
    )
    async with s.stack.grpc.channel() as ch:
        stub = pb_grpc.ApplianceStub(ch)
        call = stub.Generate(request, metadata=[("authorization", f"Bearer {KEY}")])
        return "".join([r.text async for r in call])


def test_native_grpc_adapter_field_selects_the_adapter(served) -> None:
    with_a = served.expect(PROMPT, "a")
    assert served.stack.run(_generate(served, adapter="a")) == with_a
    assert served.stack.run(_generate(served, model="a")) == with_a
    assert served.stack.run(_generate(served, model="tiny", adapter="a")) == with_a
    for fields, code in (
        ({"adapter": "nope"}, grpc.StatusCode.NOT_FOUND),
        ({"model": "nope"}, grpc.StatusCode.NOT_FOUND),
        ({"model": "other", "adapter": "a"}, grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            served.stack.run(_generate(served, **fields))
        assert info.value.code() == code, fields

    async def models() -> list[pb.Model]:
        async with served.stack.grpc.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            resp = await stub.ListModels(pb.ListModelsRequest(), metadata=[("authorization", f"Bearer {KEY}")])  # fmt: skip
            return list(resp.models)

    listed = {m.id: m for m in served.stack.run(models())}
    assert listed["a"].parent == "tiny" and listed["a"].root == str(served.dirs["a"])


def test_kserve_selects_the_adapter_by_model_name(served) -> None:
    metadata = [("authorization", f"Bearer {KEY}")]

    async def go() -> tuple[bool, bool, str, str, str]:
        async with served.stack.grpc.channel() as ch:
            stub = kpb_grpc.GRPCInferenceServiceStub(ch)
            ready = await stub.ModelReady(kpb.ModelReadyRequest(name="a"), metadata=metadata)
            unknown = await stub.ModelReady(kpb.ModelReadyRequest(name="b"), metadata=metadata)
            meta = await stub.ModelMetadata(kpb.ModelMetadataRequest(name="a"), metadata=metadata)
            sampling = _sp(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            req = _kserve(PROMPT.encode(), sampling, model="a", exclude_input_in_output=True)
            resp = await stub.ModelInfer(req, metadata=metadata)
            text = decode_bytes(resp.raw_output_contents[0], "text_output")[0].decode()
            return ready.ready, unknown.ready, meta.name, resp.model_name, text

    ready, unknown, name, answered_by, text = served.stack.run(go())
    assert ready and not unknown and name == "a" and answered_by == "a"
    assert text == served.expect(PROMPT, "a")


# ---- appliance serve ----------------------------------------------------------------------------
def test_a_bad_module_stops_appliance_serve_naming_it(tiny_llama_dir, tmp_path) -> None:
    import os
    import subprocess
    import sys

    from tests.support.served_stack import ROOT, tiny_serve_sets

    config = tmp_path / "lora.yaml"
    config.write_text(f"lora:\n  enabled: true\n  modules:\n    broken: {tmp_path / 'nothing'}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config),
         *tiny_serve_sets(tiny_llama_dir, grpc=False)],
        capture_output=True, text=True, timeout=HANG_S, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")},
             "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: lora.modules.broken:" in proc.stderr
    assert "the directory does not exist" in proc.stderr


def test_appliance_serve_loads_the_modules_for_both_frontends(tiny_llama_dir, tmp_path) -> None:
    from tests.support.served_stack import spawn_serve, tiny_serve_sets

    adapter = make_tiny_adapter(tiny_llama_dir, tmp_path / "sql", r=4, seed=5)
    config = tmp_path / "lora.yaml"
    config.write_text(f"lora:\n  enabled: true\n  modules:\n    sql: {adapter}\n")
    sp = spawn_serve(["serve", "--config", str(config), *tiny_serve_sets(tiny_llama_dir)])
    try:
        models = httpx.get(f"{sp.url}/v1/models", timeout=HANG_S).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("sql", "tiny")]
        with grpc.insecure_channel(sp.grpc_address) as ch:
            stub = kpb_grpc.GRPCInferenceServiceStub(ch)
            assert stub.ModelReady(kpb.ModelReadyRequest(name="sql"), timeout=HANG_S).ready
        assert sp.logged("adapters ready")[0]["names"] == "sql"
    finally:
        sp.kill()
