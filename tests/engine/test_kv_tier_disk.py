"""The KV disk tier across engines and under faults: a restart on the same directory serves
the first returning turn from the tier, another model or block size ignores the files with
one log line, corrupt / truncated / deleted / foreign-format files are computed instead,
the directory never exceeds its bytes, ENOSPC and EIO from the writer switch the tier off
while serving goes on, and a directory that cannot hold the tier refuses to start."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from engine.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, RuntimeConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker.kv_tier.disk_store import FileOps
from tests.support.offline import run_to_finals

BS = 4


def _engine(model_dir: Path, tier: Path | None, *, blocks: int = 16, gib: float = 0.01, **cache):
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(model_dir), max_model_len=64, dtype="float32"),
            cache=CacheConfig(
                block_size=cache.pop("block_size", BS), num_kv_blocks=blocks,
                disk_tier_dir=None if tier is None else str(tier), disk_tier_gib=gib, **cache,
            ),
            runtime=RuntimeConfig(device="cpu", num_threads=1),
        )
    )  # fmt: skip


def _run(eng: LLMEngine, prompts: dict[str, list[int]], max_tokens: int = 5) -> dict:
    for rid, p in prompts.items():
        eng.add_request(
            rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
    return run_to_finals(eng)


def _prompt(seed: int, n: int = 30) -> list[int]:
    return [(seed * 37 + 11 * i) % 480 + 5 for i in range(n)]


def _block_files(tier: Path) -> list[Path]:
    return sorted(tier.glob("kv-*/*/*.kvb"))


def _bytes_on_disk(tier: Path) -> int:
    """Bytes of the tier's block files now; a file the tier's thread evicts between the
    listing and its stat is gone, so it counts nothing."""
    total = 0
    for f in _block_files(tier):
        try:
            total += f.stat().st_size
        except FileNotFoundError:
            pass
    return total


def _evict(eng: LLMEngine, seed: int = 99) -> None:
    """A request that takes the whole small pool: no earlier block stays in it."""
    _run(eng, {f"evict-{seed}": _prompt(seed, 61)}, max_tokens=3)


# ---- warm restart -----------------------------------------------------------------------------


def test_a_restart_on_the_same_directory_serves_returning_turns_from_the_tier(
    tiny_llama_dir, tmp_path
):
    tier = tmp_path / "tier"
    firsts = {f"c{i}": _prompt(i) for i in range(3)}
    eng = _engine(tiny_llama_dir, tier)
    answers = _run(eng, firsts)
    seconds = {rid: p + answers[rid].outputs[0].token_ids + [1, 2, 3] for rid, p in firsts.items()}
    assert eng.flush_kv_tier(30.0) >= 0
    eng.close()
    files = _block_files(tier)
    assert len(files) >= 3 * 7  # every conversation's full blocks

    cold = _run(_engine(tiny_llama_dir, None), seconds)
    warm_eng = _engine(tiny_llama_dir, tier)
    # Warm: each returning turn's history comes back from disk, output unchanged.
    for rid, p in seconds.items():
        out = _run(warm_eng, {rid: p})[rid]
        assert out.outputs[0].token_ids == cold[rid].outputs[0].token_ids
        assert out.metrics.num_cached_tokens == (len(firsts[rid]) + 4) // BS * BS
    st = warm_eng.stats().kv_tier
    assert st.hit_tokens["disk"] == sum((len(p) + 4) // BS * BS for p in firsts.values())


def test_drain_flush_writes_blocks_still_only_in_the_pool(tiny_llama_dir, tmp_path):
    tier = tmp_path / "tier"
    eng = _engine(tiny_llama_dir, tier)
    eng.kv_tier.max_held = 0  # saving on free is off: only the drain writes
    _run(eng, {"a": _prompt(1)})
    assert _block_files(tier) == []
    assert eng.flush_kv_tier(30.0) == 8  # 34 computed tokens: 8 full blocks
    assert len(_block_files(tier)) == 8


def test_another_block_size_or_model_on_the_directory_ignores_it_with_one_log_line(
    tiny_llama_dir, tiny_checkpoint, tmp_path, caplog
):
    tier = tmp_path / "tier"
    eng = _engine(tiny_llama_dir, tier)
    _run(eng, {"a": _prompt(1)})
    eng.flush_kv_tier(30.0)
    eng.close()
    for other in (
        lambda: _engine(tiny_llama_dir, tier, block_size=8, blocks=8),
        lambda: _engine(tiny_checkpoint("qwen2"), tier),
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine.worker.kv_tier.setup"):
            eng = other()
        lines = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
        assert len(lines) == 1 and "other fingerprint" in lines[0], lines
        out = _run(eng, {"a": _prompt(1)})["a"]
        assert out.metrics.num_cached_tokens == 0
        assert eng.stats().kv_tier.hit_tokens["disk"] == 0
    assert "block_size" in lines[0] or "weights" in lines[0]


# ---- corruption -------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete", "other_format"])
def test_damaged_files_are_computed_instead_and_never_served(damage, tiny_llama_dir, tmp_path):
    tier = tmp_path / "tier"
    eng = _engine(tiny_llama_dir, tier)
    want = _run(eng, {"a": _prompt(1)})["a"].outputs[0].token_ids
    _run(eng, {"warm": _prompt(1)})  # no-op for the tier: already saved
    _evict(eng)
    victims = _block_files(tier)
    assert victims
    for f in victims:
        data = bytearray(f.read_bytes())
        if damage == "truncate":
            f.write_bytes(bytes(data[: len(data) // 2]))
        elif damage == "bitflip":
            data[-5] ^= 0x10
            f.write_bytes(bytes(data))
        elif damage == "delete":
            f.unlink()
        else:  # a future format version: never parsed as ours
            data[4] = 2
            f.write_bytes(bytes(data))
    out = _run(eng, {"b": _prompt(1)})["b"]
    assert out.outputs[0].token_ids == want
    st = eng.stats().kv_tier
    assert out.metrics.num_cached_tokens == 0 and st.hit_tokens["disk"] == 0
    assert st.load_failures >= 1
    # The failed entries left the index, so b's blocks were saved again when b finished:
    # the next return of this prefix is served from the tier.
    _evict(eng, 98)
    again = _run(eng, {"c": _prompt(1)})["c"]
    assert again.outputs[0].token_ids == want
    assert again.metrics.num_cached_tokens == 28 and eng.stats().kv_tier.hit_tokens["disk"] == 28


# ---- bounds and injected I/O errors ------------------------------------------------------------


def test_the_directory_never_exceeds_the_tiers_bytes(tiny_llama_dir, tmp_path):
    tier = tmp_path / "tier"
    cap_files = 10
    eng = _engine(tiny_llama_dir, tier)
    file_bytes = eng.kv_tier.sizes.disk_file_bytes
    eng.close()
    eng = _engine(tiny_llama_dir, tier, gib=cap_files * file_bytes / (1 << 30))
    for i in range(6):
        eng.add_request(f"r{i}", _prompt(i + 10), SamplingParams(max_tokens=3, temperature=0.0))
        while eng.has_unfinished_requests():
            eng.step()
            assert _bytes_on_disk(tier) <= cap_files * file_bytes
    assert len(_block_files(tier)) == cap_files


class _FailingOps(FileOps):
    def __init__(self, err: int):
        self.err = err
        self.armed = False

    def write_new(self, path, chunks):
        if self.armed and path.endswith(".tmp"):
            raise OSError(self.err, os.strerror(self.err))
        return super().write_new(path, chunks)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_full_or_failing_disk_switches_the_tier_off_and_serving_goes_on(
    err, tiny_llama_dir, tmp_path, caplog
):
    tier = tmp_path / "tier"
    eng = _engine(tiny_llama_dir, tier)
    ops = _FailingOps(err)
    eng.kv_tier_worker.disk.ops = ops
    want = _run(eng, {"a": _prompt(1)})["a"].outputs[0].token_ids
    ops.armed = True
    with caplog.at_level(logging.ERROR):
        got = _run(eng, {f"r{i}": _prompt(i + 2) for i in range(3)})
        _evict(eng)
        again = _run(eng, {"a2": _prompt(1)})["a2"]
    st = eng.stats().kv_tier
    assert st.disk_error is not None and f"Errno {err}" in st.disk_error
    assert eng.kv_tier.disk is None
    logged = [r for r in caplog.records if "disk tier" in r.getMessage()]
    assert len(logged) == 2  # the worker's line and the core's, once each
    assert len(got) == 3 and again.outputs[0].token_ids == want
    assert eng.stats().num_free_blocks == 16


# ---- bad input --------------------------------------------------------------------------------


def test_a_directory_that_cannot_be_created_or_written_refuses_to_start(tiny_llama_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError) as e:
        _engine(tiny_llama_dir, blocker / "tier")
    assert e.value.key == "cache.disk_tier_dir"
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ConfigError) as e:
            _engine(tiny_llama_dir, ro)
        assert e.value.key == "cache.disk_tier_dir"


def test_a_filesystem_without_atomic_rename_refuses_to_start(tiny_llama_dir, tmp_path, monkeypatch):
    def no_replace(self, src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(FileOps, "replace", no_replace)
    with pytest.raises(ConfigError) as e:
        _engine(tiny_llama_dir, tmp_path / "tier")
    assert e.value.key == "cache.disk_tier_dir" and "cross-device" in str(e.value)


def test_a_tier_smaller_than_one_block_refuses_to_start(tiny_llama_dir, tmp_path):
    with pytest.raises(ConfigError) as e:
        _engine(tiny_llama_dir, tmp_path / "tier", gib=1e-9)
    assert e.value.key == "cache.disk_tier_gib" and "no KV block" in str(e.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [("disk_tier_gib", 0), ("disk_tier_gib", -1.0), ("host_tier_gib", -0.5),
     ("disk_tier_rescan_s", 0)],
)  # fmt: skip
def test_sizes_at_or_below_zero_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        CacheConfig(disk_tier_dir="/tmp/x", **{key: value})
    assert e.value.key == f"cache.{key}"


def test_the_tiers_need_the_prefix_cache():
    with pytest.raises(ConfigError) as e:
        CacheConfig(disk_tier_dir="/tmp/x", enable_prefix_caching=False)
    assert e.value.key == "cache.disk_tier_dir"
