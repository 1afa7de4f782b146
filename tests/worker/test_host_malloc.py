"""runtime.malloc_keep_mib: glibc's malloc keeps freed memory, so repeated large activations
stop page-faulting (engine/worker/host_malloc.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ConfigError, RuntimeConfig
from engine.worker import host_malloc

ROOT = Path(__file__).resolve().parents[2]
GLIBC = host_malloc.glibc_version() is not None

# Rounds of three tensors written and freed together, their size cycling 2, 4, ... 16 MiB
# as a step's activations follow its token count: glibc's own thresholds (which follow the
# largest block freed, the trim threshold twice that) give much of it back to the OS as
# the sizes move, so later rounds fault pages in again. 8 rounds first (one whole cycle, so
# a kept heap has reached its size), then 16 counted.
_ROUNDS = """
import json, resource, sys, torch
from engine.worker.host_malloc import keep_freed_memory
tuned = keep_freed_memory(int(sys.argv[1]))
def round_(i):
    ts = [torch.empty((2 * (1 + i % 8)) << 18, dtype=torch.float32) for _ in range(3)]
    for t in ts:
        t.fill_(1.0)
    del ts
for i in range(8):
    round_(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(8, 24):
    round_(i)
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({"tuned": tuned, "faults": after - before}))
"""

# Pages the 16 counted rounds write: 2 cycles of 3 x (2 + 4 + ... + 16) MiB.
PAGES_WRITTEN = 2 * 3 * sum(range(2, 17, 2)) * (1 << 20) // 4096


def _faults(keep_mib: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, str(keep_mib)],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_kept_memory_stops_the_rounds_page_faults():
    control = _faults(0)  # glibc's defaults
    tuned = _faults(1024)
    assert control["tuned"] is False and tuned["tuned"] is True
    # glibc's defaults (2.36): ~46,000 of the 110,592 pages written come back as faults
    assert control["faults"] > PAGES_WRITTEN // 5, control
    # kept: the rounds reuse the heap (0-5,632 faults measured)
    assert tuned["faults"] < PAGES_WRITTEN // 10, tuned


def test_zero_leaves_malloc_alone(monkeypatch):
    monkeypatch.setattr(host_malloc, "glibc_version", lambda: pytest.fail("looked at libc"))
    assert host_malloc.keep_freed_memory(0) is False


def test_another_c_library_is_left_alone(monkeypatch, caplog):
    monkeypatch.setattr(host_malloc, "glibc_version", lambda: None)
    with caplog.at_level("INFO", logger=host_malloc.__name__):
        assert host_malloc.keep_freed_memory(1024) is False
    assert "not glibc" in caplog.text


@pytest.mark.parametrize("bad", [-1, 2048, 1.5, "1024"])
def test_out_of_range_values_name_the_key(bad):
    with pytest.raises(ConfigError) as e:
        RuntimeConfig(malloc_keep_mib=bad)
    assert e.value.key == "runtime.malloc_keep_mib"


def test_the_engine_tunes_once_loaded_on_the_cpu(tiny_llama_dir, monkeypatch):
    from engine import llm_engine
    from engine.llm import LLM

    calls = []
    allocated = []
    real_alloc = llm_engine.ModelRunner.allocate_kv_cache

    def alloc(self, num_blocks):
        allocated.append(num_blocks)
        real_alloc(self, num_blocks)

    monkeypatch.setattr(llm_engine.ModelRunner, "allocate_kv_cache", alloc)
    monkeypatch.setattr(
        llm_engine, "keep_freed_memory", lambda mib: calls.append((mib, len(allocated)))
    )
    LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, malloc_keep_mib=256)
    assert calls == [(256, 1)]  # once, after the KV cache was allocated
