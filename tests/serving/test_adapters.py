"""AdapterRegistry on its own: ids, start-up modules, the path policy and the load/unload
states, against a stand-in engine that records what it is asked and can be held mid-call.
(The served routes and the real engine: test_adapters_http.py, test_adapters_grpc.py.)"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from appliance.adapters import AdapterError, AdapterRegistry
from appliance.config import ConfigError
from appliance.config.schema import LoRASection
from engine.errors import InvalidRequestError
from engine.lora_request import LoRARequest


class StandInEngine:
    """Records add_lora/remove_lora; `refuse[name]` makes add_lora raise that message; a
    set `hold` event keeps the matching call waiting until the test sets `release`."""

    def __init__(self) -> None:
        self.added: list[LoRARequest] = []
        self.removed: list[str] = []
        self.refuse: dict[str, str] = {}
        self.hold_add = False
        self.hold_remove = False
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def add_lora(self, lora: LoRARequest) -> None:
        if self.hold_add:
            self.entered.set()
            await self.release.wait()
        if lora.lora_name in self.refuse:
            raise InvalidRequestError(self.refuse[lora.lora_name], "lora_path")
        self.added.append(lora)

    async def remove_lora(self, lora_name: str) -> None:
        if self.hold_remove:
            self.entered.set()
            await self.release.wait()
        self.removed.append(lora_name)


def _adapter_dir(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text("{}")
    return d


def _registry(engine: StandInEngine, tmp_path: Path, **lora) -> AdapterRegistry:
    section = LoRASection(
        enabled=True,
        allow_runtime_updates=True,
        allowed_dirs=(str(tmp_path / "allowed"),),
        **lora,
    )
    return AdapterRegistry(engine, section, base_name="tiny")


def _refused(coro, status: int, code: str | None = None) -> AdapterError:
    with pytest.raises(AdapterError) as info:
        asyncio.run(coro)
    assert info.value.status == status, info.value.message
    if code is not None:
        assert info.value.code == code
    return info.value


# ---- start-up ---------------------------------------------------------------------------------
def test_startup_modules_are_numbered_in_yaml_order_and_routable(tmp_path) -> None:
    engine = StandInEngine()
    reg = _registry(engine, tmp_path, modules={"sql": "/a/sql", "chat": "/a/chat"})
    asyncio.run(reg.load_modules())
    assert engine.added == [LoRARequest("sql", 1, "/a/sql"), LoRARequest("chat", 2, "/a/chat")]
    assert reg.adapters() == engine.added
    assert reg.get("chat") == LoRARequest("chat", 2, "/a/chat")
    assert reg.get("tiny") is None and reg.get("other") is None


def test_a_module_the_engine_refuses_fails_startup_naming_its_key(tmp_path) -> None:
    engine = StandInEngine()
    engine.refuse["bad"] = "adapter rank 64 exceeds lora.max_lora_rank (16)"
    reg = _registry(engine, tmp_path, modules={"ok": "/a/ok", "bad": "/a/bad"})
    with pytest.raises(ConfigError) as info:
        asyncio.run(reg.load_modules())
    assert info.value.key == "lora.modules.bad"
    assert "rank 64" in str(info.value)


@pytest.mark.parametrize(
    ("name", "reason"), [("tiny", "base model"), ("a,b", "each a letter, a digit")]
)
def test_a_module_name_that_cannot_be_routed_fails_startup(tmp_path, name, reason) -> None:
    reg = _registry(StandInEngine(), tmp_path, modules={name: "/a/x"})
    with pytest.raises(ConfigError) as info:
        asyncio.run(reg.load_modules())
    assert info.value.key == f"lora.modules.{name}" and reason in str(info.value)


def test_runtime_updates_need_an_allowed_directory() -> None:
    with pytest.raises(ConfigError) as info:
        LoRASection(enabled=True, allow_runtime_updates=True)
    assert info.value.key == "lora.allowed_dirs"


# ---- runtime loads ----------------------------------------------------------------------------
def test_load_gives_the_engine_the_real_path_and_a_fresh_id(tmp_path) -> None:
    engine = StandInEngine()
    reg = _registry(engine, tmp_path, modules={"sql": "/a/sql"})
    d = _adapter_dir(tmp_path / "allowed", "one")
    (tmp_path / "allowed" / "link").symlink_to(d)

    async def go() -> None:
        await reg.load_modules()
        lora = await reg.load("one", str(tmp_path / "allowed" / "sub" / ".." / "link"))
        assert lora == LoRARequest("one", 2, os.path.realpath(d))
        await reg.unload("one")
        again = await reg.load("one", str(d))
        assert again.lora_int_id == 3  # never the old id: the prefix cache keys blocks by it

    asyncio.run(go())
    assert [lo.lora_int_id for lo in engine.added] == [1, 2, 3]
    assert engine.removed == ["one"]


def test_load_is_refused_when_runtime_updates_are_off(tmp_path) -> None:
    section = LoRASection(enabled=True, allowed_dirs=(str(tmp_path),))
    reg = AdapterRegistry(StandInEngine(), section, base_name="tiny")
    _adapter_dir(tmp_path, "x")
    _refused(reg.load("x", str(tmp_path / "x")), 404, "not_found")
    _refused(reg.unload("x"), 404, "not_found")


def test_paths_outside_the_allowed_dirs_are_forbidden_however_spelled(tmp_path) -> None:
    engine = StandInEngine()
    reg = _registry(engine, tmp_path)
    outside = _adapter_dir(tmp_path, "outside")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "escape").symlink_to(outside)
    (tmp_path / "allowed-sibling").mkdir()  # a prefix of the name is not a parent directory
    spellings = [
        str(outside),
        str(allowed / ".." / "outside"),
        str(allowed / "escape"),
        str(tmp_path / "allowed-sibling"),
        "/etc",
    ]
    for path in spellings:
        err = _refused(reg.load("x", path), 403, "path_not_allowed")
        assert err.param == "lora_path" and "lora.allowed_dirs" in err.message
    assert engine.added == []


def test_bad_names_and_paths_are_refused_before_the_engine_sees_them(tmp_path) -> None:
    engine = StandInEngine()
    reg = _registry(engine, tmp_path)
    _adapter_dir(tmp_path / "allowed", "x")
    assert _refused(reg.load("", "/x"), 400).param == "lora_name"
    assert _refused(reg.load("tiny", "/x"), 400).param == "lora_name"
    assert _refused(reg.load("x", ""), 400).param == "lora_path"
    assert "absolute" in _refused(reg.load("x", "allowed/x"), 400).message
    missing = _refused(reg.load("x", str(tmp_path / "allowed" / "nope")), 404)
    assert missing.code == "adapter_not_found"
    assert engine.added == []


def test_an_adapter_the_engine_refuses_is_a_400_with_the_engines_reason(tmp_path) -> None:
    engine = StandInEngine()
    engine.refuse["x"] = "adapter_config.json: target module 'lm_head' is not supported"
    reg = _registry(engine, tmp_path)
    d = _adapter_dir(tmp_path / "allowed", "x")
    err = _refused(reg.load("x", str(d)), 400)
    assert "lm_head" in err.message and err.param == "lora_path"
    assert reg.get("x") is None
    engine.refuse.clear()
    asyncio.run(reg.load("x", str(d)))  # the name is free again
    assert reg.get("x") is not None


def test_a_name_is_loaded_once_even_by_concurrent_loads(tmp_path) -> None:
    engine = StandInEngine()
    engine.hold_add = True
    reg = _registry(engine, tmp_path)
    d = str(_adapter_dir(tmp_path / "allowed", "x"))

    async def go() -> None:
        first = asyncio.create_task(reg.load("x", d))
        await engine.entered.wait()
        assert reg.get("x") is None  # not routable before the engine holds it
        with pytest.raises(AdapterError) as info:
            await reg.load("x", d)
        assert info.value.status == 400 and "being updated" in info.value.message
        engine.release.set()
        await first
        with pytest.raises(AdapterError) as info:
            await reg.load("x", d)
        assert "already been loaded" in info.value.message

    asyncio.run(go())
    assert len(engine.added) == 1


def test_a_load_whose_caller_leaves_still_completes(tmp_path) -> None:
    engine = StandInEngine()
    engine.hold_add = True
    reg = _registry(engine, tmp_path)
    d = str(_adapter_dir(tmp_path / "allowed", "x"))

    async def go() -> None:
        caller = asyncio.create_task(reg.load("x", d))
        await engine.entered.wait()
        caller.cancel()
        engine.release.set()
        for _ in range(10_000):  # the shielded load carries on to the end
            if reg.get("x") is not None:
                break
            await asyncio.sleep(0)
        assert reg.get("x") is not None

    asyncio.run(go())
    assert [lo.lora_name for lo in engine.added] == ["x"]


# ---- unloads ----------------------------------------------------------------------------------
def test_unload_stops_routing_at_once_and_returns_when_the_engine_is_done(tmp_path) -> None:
    engine = StandInEngine()
    reg = _registry(engine, tmp_path, modules={"sql": "/a/sql"})

    async def go() -> None:
        await reg.load_modules()
        engine.hold_remove = True
        unload = asyncio.create_task(reg.unload("sql"))
        await engine.entered.wait()
        assert reg.get("sql") is None and reg.adapters() == []
        assert not unload.done()
        with pytest.raises(AdapterError) as info:  # still in the engine: not loadable yet
            await reg.load("sql", str(_adapter_dir(tmp_path / "allowed", "sql")))
        assert "being updated" in info.value.message
        with pytest.raises(AdapterError) as info:
            await reg.unload("sql")
        assert info.value.status == 404
        engine.release.set()
        await unload

    asyncio.run(go())
    assert engine.removed == ["sql"]


def test_unloading_an_unknown_adapter_is_a_404(tmp_path) -> None:
    err = _refused(_registry(StandInEngine(), tmp_path).unload("nope"), 404, "model_not_found")
    assert err.message == "The lora adapter 'nope' cannot be found."


def test_requests_are_counted_per_adapter_name(tmp_path) -> None:
    reg = _registry(StandInEngine(), tmp_path)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    for lora in (a, b, a):
        reg.count_request(lora)
    assert reg.request_counts() == {"a": 2, "b": 1}


# ---- admissions -------------------------------------------------------------------------------
def test_a_request_resolved_before_an_unload_is_refused_after_it(tmp_path) -> None:
    reg = _registry(StandInEngine(), tmp_path, modules={"sql": "/a/sql"})
    asyncio.run(reg.load_modules())
    lora = reg.get("sql")
    assert lora is not None
    asyncio.run(reg.unload("sql"))
    with pytest.raises(AdapterError) as info, reg.admitting(lora):
        pass
    assert info.value.status == 404 and info.value.code == "model_not_found"


def test_an_unload_waits_for_admissions_before_the_engine_removes_the_adapter(tmp_path) -> None:
    engine = StandInEngine()
    reg = _registry(engine, tmp_path, modules={"sql": "/a/sql"})

    async def go() -> None:
        await reg.load_modules()
        engine.hold_remove = True
        engine.release.set()  # remove_lora itself does not wait; only the admission may
        lora = reg.get("sql")
        with reg.admitting(lora):  # a request being handed to the engine
            unload = asyncio.create_task(reg.unload("sql"))
            for _ in range(20):  # without the wait, remove_lora would run within these
                await asyncio.sleep(0)
            assert reg.get("sql") is None  # already unroutable
            assert not engine.entered.is_set() and engine.removed == []
        await unload
        assert engine.removed == ["sql"]

    asyncio.run(go())
