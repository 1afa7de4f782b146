"""The host tier's whole path on the CPU. In production `cache.host_tier_gib` on the CPU
grows the pool instead (a host tier there would copy within the same memory); here the plan
is forced to a host tier of pinned-like host slots so the path the GPU takes (slots assigned
by the core, pool -> slot copies, loads from the slot, write-through to disk) runs, and
its greedy output must equal an engine without tiers."""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.worker.kv_tier import setup

SMALL = dict(num_kv_blocks=16, block_size=4, max_model_len=64, dtype="float32")


def _turns(llm: LLM, firsts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = []
    for p in firsts + [f + [5, 6, 7, 8] for f in firsts]:
        outs.append(
            llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
        )
    return outs


@pytest.fixture
def host_tier_on_cpu(monkeypatch):
    plan = setup.plan_kv_tiers

    def as_on_gpu(cache, block_bytes, device, tp_size=1):
        p = plan(cache, block_bytes, device, tp_size)
        return dataclasses.replace(p, extra_pool_blocks=0, host_slots=p.extra_pool_blocks)

    monkeypatch.setattr("engine.llm_engine.plan_kv_tiers", as_on_gpu)


def test_cpu_host_tier_gib_grows_the_pool(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **SMALL, host_tier_gib=16 * 2048 / (1 << 30))
    assert llm.engine.stats().num_blocks == 32 and llm.engine.kv_tier is None


@pytest.mark.parametrize("with_disk", [False, True])
def test_the_host_tier_path_keeps_greedy_output(
    with_disk, host_tier_on_cpu, tiny_llama_dir, tmp_path
):
    firsts = [[(i * 31 + 7 * j) % 400 + 5 for j in range(26)] for i in range(3)]
    want = _turns(LLM(str(tiny_llama_dir), **SMALL), firsts)
    disk = {"disk_tier_dir": str(tmp_path / "tier"), "disk_tier_gib": 0.01} if with_disk else {}
    # 24 host slots: the three conversations (7 full blocks each) fit, the pool does not.
    llm = LLM(str(tiny_llama_dir), **SMALL, host_tier_gib=24 * 2048 / (1 << 30), **disk)
    assert llm.engine.kv_tier.host is not None and llm.engine.stats().num_blocks == 16
    assert _turns(llm, firsts) == want
    st = llm.engine.stats().kv_tier
    assert st.hit_tokens["host"] > 0
    assert st.bytes_written["host"] > 0
    if with_disk:
        assert st.bytes_written["disk"] > 0
