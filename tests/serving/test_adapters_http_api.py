"""The adapter routes' HTTP mechanics in-process over the fake engine: /v1/models, the
`model` field's 404, load/unload statuses and bodies, the lora metrics. Adapters come from
a stand-in (test_adapters.StandInEngine); the real engine serving real adapters is in
test_adapters_served.py. (API keys on these routes: test_security.py.)"""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from appliance.adapters import AdapterRegistry
from appliance.config import ServerConfig
from appliance.config.schema import LoRASection
from appliance.http.app import build_app
from engine.async_engine import AsyncEngine
from tests.serving.test_adapters import StandInEngine, _adapter_dir
from tests.serving.test_http_api import _assert_error, run
from tests.support.fake_engine import FakeLLMEngine

BASE = "fake-model"


async def _with_client(fn, lora: LoRASection):
    fake, adapter_engine = FakeLLMEngine(), StandInEngine()
    aeng = AsyncEngine(fake)
    adapters = AdapterRegistry(adapter_engine, lora, BASE)
    await adapters.load_modules()
    app = build_app(aeng, ServerConfig(), version="9.9.9", adapters=adapters)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as c:
            return await fn(c, fake, adapter_engine)
    finally:
        await aeng.shutdown()


def _runtime(tmp_path: Path, **kw) -> LoRASection:
    allowed = tmp_path / "allowed"
    allowed.mkdir(exist_ok=True)
    return LoRASection(enabled=True, allow_runtime_updates=True, allowed_dirs=(str(allowed),), **kw)


def test_models_lists_the_adapters_with_their_parent_and_root(tmp_path) -> None:
    async def fn(c, fake, _):
        data = (await c.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in data] == [
            (BASE, None, None),
            ("sql", BASE, "/a/sql"),
            ("chat", BASE, "/a/chat"),
        ]
        card = (await c.get("/v1/models/chat")).json()
        assert card["id"] == "chat" and card["parent"] == BASE and card["object"] == "model"
        _assert_error(await c.get("/v1/models/nope"), 404, "model", "model_not_found")

    run(_with_client(fn, _runtime(tmp_path, modules={"sql": "/a/sql", "chat": "/a/chat"})))


def test_an_unknown_model_is_a_404_and_the_base_name_still_works(tmp_path) -> None:
    async def fn(c, fake, _):
        for path, body in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/tokenize", {"prompt": "hi"}),
            ("/detokenize", {"tokens": [104]}),
        ):
            err = _assert_error(
                await c.post(path, json={**body, "model": "nope"}), 404, "model", "model_not_found"
            )
            assert "GET /v1/models" in err["message"]
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "model": BASE})
        assert r.status_code == 200 and r.json()["model"] == BASE
        assert len(fake.requests) == 1  # the refused ones never reached the engine

    run(_with_client(fn, _runtime(tmp_path, modules={"sql": "/a/sql"})))


def test_load_then_unload_over_http_answers_as_vllm(tmp_path) -> None:
    lora = _runtime(tmp_path)
    d = _adapter_dir(tmp_path / "allowed", "one")

    async def fn(c, fake, adapter_engine):
        body = {"lora_name": "one", "lora_path": str(d)}
        r = await c.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 200, r.text
        assert r.text == "Success: LoRA adapter 'one' added successfully."
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [BASE, "one"]
        err = _assert_error(await c.post("/v1/load_lora_adapter", json=body), 400, "lora_name")
        assert err["message"] == "The lora adapter 'one' has already been loaded."
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "one"})
        assert (
            r.status_code == 200 and r.text == "Success: LoRA adapter 'one' removed successfully."
        )
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [BASE]
        _assert_error(
            await c.post("/v1/unload_lora_adapter", json={"lora_name": "one"}),
            404, "lora_name", "model_not_found",
        )  # fmt: skip
        assert [lo.lora_name for lo in adapter_engine.added] == ["one"]
        assert adapter_engine.removed == ["one"]

    run(_with_client(fn, lora))


def test_load_refusals_are_openai_errors_with_the_right_status(tmp_path) -> None:
    lora = _runtime(tmp_path)
    outside = _adapter_dir(tmp_path, "outside")
    bad = _adapter_dir(tmp_path / "allowed", "bad")

    async def fn(c, fake, adapter_engine):
        adapter_engine.refuse["bad"] = "adapter_config.json: r=64 exceeds lora.max_lora_rank=16"
        load = "/v1/load_lora_adapter"
        err = _assert_error(
            await c.post(load, json={"lora_name": "x", "lora_path": str(outside)}),
            403, "lora_path", "path_not_allowed",
        )  # fmt: skip
        assert "lora.allowed_dirs" in err["message"]
        err = _assert_error(
            await c.post(load, json={"lora_name": "bad", "lora_path": str(bad)}), 400, "lora_path"
        )
        assert "r=64 exceeds lora.max_lora_rank" in err["message"]
        _assert_error(
            await c.post(load, json={"lora_name": "x"}), 400, "lora_path",
            "missing_required_parameter",
        )  # fmt: skip
        _assert_error(
            await c.post(load, json={"lora_name": "x", "lora_path": "/a", "load_inplace": True}),
            400, "load_inplace", "unknown_parameter",
        )  # fmt: skip
        _assert_error(
            await c.post(load, json={"lora_name": BASE, "lora_path": str(bad)}), 400, "lora_name"
        )
        missing = str(tmp_path / "allowed" / "missing")
        _assert_error(
            await c.post(load, json={"lora_name": "x", "lora_path": missing}),
            404, "lora_path", "adapter_not_found",
        )  # fmt: skip
        assert adapter_engine.added == []

    run(_with_client(fn, lora))


def test_runtime_updates_off_refuses_both_routes_before_reading_the_body(tmp_path) -> None:
    lora = LoRASection(enabled=True, modules={"sql": "/a/sql"})

    async def fn(c, fake, adapter_engine):
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            err = _assert_error(await c.post(path, content=b"not json"), 404, None, "not_found")
            assert "lora.allow_runtime_updates" in err["message"]
        assert adapter_engine.removed == []

    run(_with_client(fn, lora))


def test_lora_metrics_count_per_adapter_and_expose_vllms_info_gauge(tmp_path) -> None:
    async def fn(c, fake, _):
        fake._stats.lora_running = {"sql": 2, "chat": 0}
        fake._stats.lora_waiting = {"chat": 1}
        # A request makes the engine loop take a fresh stats snapshot.
        await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        fams = {f.name: f for f in text_string_to_metric_families((await c.get("/metrics")).text)}
        info = fams["vllm:lora_requests_info"].samples
        assert len(info) == 1 and info[0].labels == {
            "running_lora_adapters": "sql", "waiting_lora_adapters": "chat", "max_lora": "3",
        }  # fmt: skip
        running = {
            s.labels["adapter"]: s.value for s in fams["appliance_lora_requests_running"].samples
        }
        waiting = {
            s.labels["adapter"]: s.value for s in fams["appliance_lora_requests_waiting"].samples
        }
        assert running == {"sql": 2} and waiting == {"chat": 1}

    run(_with_client(fn, _runtime(tmp_path, max_loras=3, modules={"sql": "/a", "chat": "/b"})))


def test_lora_off_exposes_no_lora_metrics() -> None:
    async def fn(c, fake, _):
        text = (await c.get("/metrics")).text
        assert "lora" not in text

    run(_with_client(fn, LoRASection()))


def test_the_openapi_document_lists_the_adapter_routes() -> None:
    async def fn(c, fake, _):
        doc = (await c.get("/openapi.json")).json()
        load = doc["paths"]["/v1/load_lora_adapter"]["post"]
        assert load["security"] == [{"bearer": []}, {}]
        assert {"200", "400", "401", "403", "404"} <= set(load["responses"])
        assert "403" not in doc["paths"]["/v1/unload_lora_adapter"]["post"]["responses"]
        schema = doc["components"]["schemas"]["LoadLoRAAdapterRequest"]
        assert set(schema["required"]) == {"lora_name", "lora_path"}
        assert "parent" in doc["components"]["schemas"]["ModelCard"]["properties"]

    run(_with_client(fn, LoRASection()))
