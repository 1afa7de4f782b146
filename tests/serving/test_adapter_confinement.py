"""Runtime adapter loads stay inside `lora.allowed_dirs`, and no adapter error is a 500.

Issue 28, D10-D12, against the real engine behind HTTP with runtime updates on:
- every file an adapter load opens must really lie inside an allowed directory: a file
  symlinked out of it is refused with a 403 that echoes nothing of the file, and the answer
  is the same whether the file outside exists or not (no oracle on the server's files);
  symlinks that stay inside (a Hugging Face cache's snapshot -> blob links) still load;
- a NUL byte in `lora_path`, and the unload of an adapter the engine's host cache already
  evicted, are answered as the client's request deserves (400 / a normal unload), never 500;
- adapter names are identifiers: bounded length, a plain character set, never echoed whole.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from appliance.config import ServerConfig
from appliance.config.schema import LoRASection
from engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, RuntimeConfig
from tests.support.served_stack import Stack, start_stack
from tests.support.tiny_lora import make_tiny_adapter
from tests.support.waiting import HANG_S

LORA = LoRAConfig(enabled=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1)


@dataclass
class Served:
    stack: Stack
    allowed: Path  # lora.allowed_dirs
    outside: Path  # a directory the server may read but adapters must not come from
    adapter: Path  # a good adapter (outside `allowed`; copy it in to use it)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.stack.url}{path}", json=body, timeout=HANG_S)

    def load(self, name: str, path: str | Path) -> httpx.Response:
        return self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    def copy(self, name: str) -> Path:
        """A copy of the good adapter inside the allowed directory."""
        dst = self.allowed / name
        shutil.copytree(self.adapter, dst)
        return dst


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from engine.llm_engine import LLMEngine

    root = tmp_path_factory.mktemp("confine")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    adapter = make_tiny_adapter(tiny_llama_dir, outside / "good", r=4, seed=1)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(
                path=str(tiny_llama_dir), served_name="tiny", max_model_len=128, dtype="float32"
            ),  # fmt: skip
            cache=CacheConfig(block_size=16, num_kv_blocks=128),
            runtime=RuntimeConfig(device="cpu", num_threads=1),
            lora=LORA,
        )
    )
    lora = LoRASection(
        enabled=True, max_loras=LORA.max_loras, max_lora_rank=LORA.max_lora_rank,
        max_cpu_loras=LORA.max_cpu_loras, allow_runtime_updates=True, allowed_dirs=(str(allowed),),
    )  # fmt: skip
    stack = start_stack(engine, ServerConfig(host="127.0.0.1", http_port=0), lora=lora)
    try:
        yield Served(stack, allowed, outside, adapter)
    finally:
        stack.close()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---- D10: files symlinked out of the allowed directory ------------------------------------
def test_weights_symlinked_outside_are_refused_with_a_403(served) -> None:
    d = served.copy("w-out")
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.safetensors").symlink_to(served.adapter / "adapter_model.safetensors")
    err = _error(served.load("w-out", d), 403)
    assert err["code"] == "path_not_allowed" and err["param"] == "lora_path", err
    assert "w-out" not in {
        m["id"] for m in httpx.get(f"{served.stack.url}/v1/models").json()["data"]
    }


def test_a_config_symlinked_to_any_file_is_refused_echoing_nothing(served) -> None:
    d = served.copy("c-out")
    secret = served.outside / "secret.txt"
    secret.write_text("root:x:0:0:the-secret-line\n")
    (d / "adapter_config.json").unlink()
    (d / "adapter_config.json").symlink_to(secret)
    err = _error(served.load("c-out", d), 403)
    assert err["code"] == "path_not_allowed", err
    assert "secret" not in err["message"] and "JSON" not in err["message"], err


def test_the_answer_does_not_tell_whether_a_file_outside_exists(served) -> None:
    d = served.copy("oracle")
    link = d / "adapter_config.json"
    link.unlink()
    link.symlink_to(served.outside / "secret-exists.txt")
    (served.outside / "secret-exists.txt").write_text("{}")
    exists = _error(served.load("oracle", d), 403)
    link.unlink()
    link.symlink_to(served.outside / "no-such-file.txt")
    missing = _error(served.load("oracle", d), 403)
    assert exists == missing, (exists, missing)


def test_symlinks_that_stay_inside_load(served) -> None:
    """A Hugging Face cache: the snapshot's files are symlinks to blobs in the same tree."""
    blobs = served.allowed / "hub" / "blobs"
    snap = served.allowed / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(served.adapter / name, blobs / f"{name}.blob")
        (snap / name).symlink_to(os.path.relpath(blobs / f"{name}.blob", snap))
    r = served.load("hub", snap)
    assert r.status_code == 200, r.text
    assert served.post("/v1/unload_lora_adapter", {"lora_name": "hub"}).status_code == 200


# ---- D11: never a 500 -----------------------------------------------------------------------
def test_a_nul_byte_in_the_path_is_a_400(served) -> None:
    err = _error(served.load("nul", f"{served.allowed}/x\u0000y"), 400)
    assert err["param"] == "lora_path", err


def test_unloading_an_adapter_the_host_cache_evicted_is_a_normal_unload(served) -> None:
    """max_cpu_loras 1: loading b drops a from the engine's host cache; a is still served
    (read again from its files when used), and unloading it is an unload, not a 500."""
    assert served.load("ev-a", served.copy("ev-a")).status_code == 200
    assert served.load("ev-b", served.copy("ev-b")).status_code == 200
    r = served.post("/v1/unload_lora_adapter", {"lora_name": "ev-a"})
    assert r.status_code == 200, r.text
    ids = {m["id"] for m in httpx.get(f"{served.stack.url}/v1/models").json()["data"]}
    assert "ev-a" not in ids and "ev-b" in ids
    r = served.post("/v1/completions", {"model": "ev-a", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404, r.text
    assert served.post("/v1/unload_lora_adapter", {"lora_name": "ev-b"}).status_code == 200


@pytest.mark.parametrize(
    "name, path",
    [
        ("nul\u0000name", "{allowed}/x"),
        ("dir", "{allowed}"),  # the allowed directory itself holds no adapter
        ("file", "{allowed}/../outside/good/adapter_config.json"),
        ("missing", "{allowed}/does/not/exist"),
        ("notjson", "{notjson}"),
    ],
)
def test_no_load_refusal_is_a_500(served, name, path) -> None:
    bad = served.allowed / "notjson"
    if not bad.exists():
        bad.mkdir()
        (bad / "adapter_config.json").write_text("{not json")
        (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    r = served.load(name, path.format(allowed=served.allowed, notjson=bad))
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


# ---- D12: names are identifiers ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["x" * 4_000_000, "two words", "line\nbreak", "tab\t", "é", ""])
def test_adapter_names_are_bounded_identifiers(served, name) -> None:
    err = _error(served.load(name, served.allowed / "any"), 400)
    assert err["param"] == "lora_name", err
    assert len(err["message"]) < 300, len(err["message"])
    err = _error(served.post("/v1/unload_lora_adapter", {"lora_name": name}), 400)
    assert err["param"] == "lora_name" and len(err["message"]) < 300


def test_a_long_unknown_model_name_is_not_echoed_whole(served) -> None:
    r = served.post("/v1/completions", {"model": "m" * 100_000, "prompt": "hi", "max_tokens": 1})
    err = _error(r, 404)
    assert len(err["message"]) < 400, len(err["message"])
