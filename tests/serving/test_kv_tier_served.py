"""The KV disk tier behind a served engine: usage.cached_tokens and /metrics count tier hits;
tier files truncated, bit-flipped or deleted under a running server are computed instead (no
500, same output); ENOSPC from the writer switches the tier off while the server serves on;
a SIGTERM drain and a restart on the same directory serve each conversation's next turn from
the tier (another block size on that directory: no hit, one log line); and two real
replicas on one directory serve each other's prefixes."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from engine.worker.kv_tier.disk_store import FileOps
from tests.support.served_stack import served, spawn_serve, tiny_serve_sets, wait_idle_and_free
from tests.support.waiting import HANG_S, wait_for

BS = 4
BLOCKS = 32  # 128 tokens: one max_model_len request, so conversations evict each other


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 41 + 13 * i) % 480 + 5 for i in range(n)]


def _complete(url: str, prompt: list[int], max_tokens: int = 6) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=HANG_S).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _files(tier: Path) -> list[Path]:
    return sorted(tier.glob("kv-*/*/*.kvb"))


def _engine(model_dir: Path, tier: Path):
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(model_dir), served_name="tiny", max_model_len=128,
                              dtype="float32"),
            cache=CacheConfig(block_size=BS, num_kv_blocks=BLOCKS, disk_tier_dir=str(tier),
                              disk_tier_gib=0.01),
            scheduler=SchedulerConfig(max_num_seqs=8),
            runtime=RuntimeConfig(device="cpu", num_threads=1),
        )
    )  # fmt: skip


def _evict(url: str) -> None:
    _complete(url, _prompt(77, 124), max_tokens=4)  # takes the whole pool


# ---- in-process server ------------------------------------------------------------------------


def test_tier_hits_count_in_cached_tokens_and_metrics(tiny_llama_dir, tmp_path):
    tier = tmp_path / "tier"
    with served(_engine(tiny_llama_dir, tier)) as stack:
        url = stack.url
        first = _complete(url, _prompt(1))
        assert _cached(first) == 0
        _evict(url)
        wait_idle_and_free(stack.aeng)
        again = _complete(url, _prompt(1))
        assert _cached(again) == 36  # 9 of the 10 prompt blocks (one token is computed)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        wait_idle_and_free(stack.aeng)
        m = {"model_name": "tiny", "tier": "disk"}
        assert _metric(url, "vllm:kv_tier_hit_tokens_total", **m) == 36
        assert _metric(url, "vllm:kv_tier_bytes_read_total", **m) > 0
        assert _metric(url, "vllm:kv_tier_bytes_written_total", **m) > 0
        assert _metric(url, "vllm:kv_tier_usage_bytes", **m) == len(_files(tier)) * (
            _files(tier)[0].stat().st_size
        )
        assert _metric(url, "vllm:kv_tier_load_latency_seconds_count", model_name="tiny") == 1


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete"])
def test_tier_files_damaged_under_a_running_server_are_computed_instead(
    damage, tiny_llama_dir, tmp_path
):
    tier = tmp_path / "tier"
    with served(_engine(tiny_llama_dir, tier)) as stack:
        url = stack.url
        want = [_complete(url, _prompt(i)) for i in range(3)]
        _evict(url)
        wait_idle_and_free(stack.aeng)
        for f in _files(tier):
            data = bytearray(f.read_bytes())
            if damage == "truncate":
                f.write_bytes(bytes(data[:100]))
            elif damage == "bitflip":
                data[200] ^= 0x01
                f.write_bytes(bytes(data))
            else:
                f.unlink()
        for i in range(3):
            got = _complete(url, _prompt(i))
            assert got["choices"][0]["text"] == want[i]["choices"][0]["text"]
            assert _cached(got) == 0
        wait_idle_and_free(stack.aeng)
        assert _metric(url, "vllm:kv_tier_load_failures_total", model_name="tiny") > 0
        assert _metric(url, "vllm:kv_tier_hit_tokens_total", model_name="tiny") == 0


class _FullDisk(FileOps):
    def write_new(self, path, chunks):
        if path.endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write_new(path, chunks)


def test_a_full_disk_switches_the_tier_off_and_the_server_keeps_serving(tiny_llama_dir, tmp_path):
    tier = tmp_path / "tier"
    eng = _engine(tiny_llama_dir, tier)
    eng.kv_tier_worker.disk.ops = _FullDisk()
    with served(eng) as stack:
        url = stack.url
        outs = [_complete(url, _prompt(i)) for i in range(4)]
        wait_idle_and_free(stack.aeng)
        assert _metric(url, "vllm:kv_tier_disk_failed", model_name="tiny") == 1
        assert _files(tier) == []
        again = _complete(url, _prompt(0))
        assert again["choices"][0]["text"] == outs[0]["choices"][0]["text"]
        assert httpx.get(f"{url}/health", timeout=HANG_S).status_code == 200


# ---- real processes ---------------------------------------------------------------------------


def _serve(model_dir: Path, tier: Path, **extra):
    sets = {"cache.block_size": BS, "cache.num_kv_blocks": BLOCKS, "cache.disk_tier_dir": str(tier),
            "cache.disk_tier_gib": 0.01, **extra}  # fmt: skip
    return spawn_serve(["serve", *tiny_serve_sets(model_dir, grpc=False, **sets)])


def _stop(sp) -> None:
    sp.proc.send_signal(signal.SIGTERM)
    assert sp.proc.wait(HANG_S) == 0


def test_sigterm_then_restart_serves_each_conversations_next_turn_from_the_tier(
    tiny_llama_dir, tmp_path
):
    tier = tmp_path / "tier"
    sp = _serve(tiny_llama_dir, tier)
    try:
        firsts = [_prompt(i) for i in range(3)]
        for p in firsts:
            _complete(sp.url, p)
        seconds = [p + [9, 9, 9, 9, 9] for p in firsts]  # each conversation's next turn
        _stop(sp)
        assert sp.logged("engine loop stopped")
    finally:
        sp.kill()
    assert any("flushed" in r.get("msg", "") for r in sp.records) or _files(tier)

    cold = tmp_path / "cold"
    ref = _serve(tiny_llama_dir, cold)
    try:
        want = [_complete(ref.url, p) for p in seconds]
    finally:
        ref.kill()

    warm = _serve(tiny_llama_dir, tier)
    try:
        for i, p in enumerate(seconds):
            got = _complete(warm.url, p)
            assert got["choices"][0]["text"] == want[i]["choices"][0]["text"]
            assert _cached(got) >= (len(firsts[i]) // BS) * BS  # its history, from disk
        assert _metric(warm.url, "vllm:kv_tier_hit_tokens_total", tier="disk") > 0
    finally:
        _stop(warm)
        warm.kill()

    other = _serve(tiny_llama_dir, tier, **{"cache.block_size": 8, "cache.num_kv_blocks": 16})
    try:
        got = _complete(other.url, seconds[0])
        assert _cached(got) == 0
        ignored = [r for r in other.records if "other fingerprint" in r.get("msg", "")]
        assert len(ignored) == 1
    finally:
        other.kill()


def test_two_replicas_on_one_directory_serve_each_others_prefixes(tiny_llama_dir, tmp_path):
    tier = tmp_path / "shared"
    a = _serve(tiny_llama_dir, tier, **{"cache.disk_tier_rescan_s": 0.2})
    b = _serve(tiny_llama_dir, tier, **{"cache.disk_tier_rescan_s": 0.2})
    try:
        from_a = _complete(a.url, _prompt(5))
        wait_for(lambda: len(_files(tier)) >= 10, "replica a's blocks on disk")
        size = _files(tier)[0].stat().st_size
        # b lists the directory on its own schedule; wait for its index, then ask it.
        wait_for(
            lambda: _metric(b.url, "vllm:kv_tier_usage_bytes", tier="disk") >= 10 * size,
            "replica b indexed a's files",
        )
        from_b = _complete(b.url, _prompt(5))
        assert from_b["choices"][0]["text"] == from_a["choices"][0]["text"]
        assert _cached(from_b) == 36
        assert _metric(b.url, "vllm:kv_tier_hit_tokens_total", tier="disk") == 36
        # And the other way round: b's new conversation warms a.
        from_b2 = _complete(b.url, _prompt(6))
        wait_for(
            lambda: _metric(a.url, "vllm:kv_tier_usage_bytes", tier="disk") >= 20 * size,
            "replica a indexed b's files",
        )
        from_a2 = _complete(a.url, _prompt(6))
        assert _cached(from_a2) == 36
        assert from_a2["choices"][0]["text"] == from_b2["choices"][0]["text"]
    finally:
        a.kill()
        b.kill()
