"""LoRA in the torch-free core: prefix-cache keys per adapter, the adapter-slot limit in the
scheduler, and the per-adapter request counts."""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.lora_request import LoRARequest
from engine.sampling_params import SamplingParams
from tests.support.scheduler_helpers import fake_runner_output

BS = 4
KEYS = {name: name.encode() * 32 for name in "abc"}  # stand-ins for adapter content keys


def lora_request(
    rid: str, tokens, adapter: str | None, salt: str | None = None, max_tokens: int = 4
) -> Request:
    lora = None if adapter is None else LoRARequest(adapter, ord(adapter), f"/adapters/{adapter}")
    return Request(
        rid,
        list(tokens),
        SamplingParams(max_tokens=max_tokens),
        cache_salt=salt,
        lora_request=lora,
        lora_key=None if adapter is None else KEYS[adapter],
    )


def cache_first(m: KVCacheManager, req: Request) -> None:
    assert m.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens


def test_prefix_cache_blocks_are_keyed_by_adapter():
    m = KVCacheManager(16, BS)
    cache_first(m, lora_request("a1", range(9), "a"))
    assert m.get_computed_blocks(lora_request("base", range(9), None)) == ([], 0)
    assert m.get_computed_blocks(lora_request("b1", range(9), "b")) == ([], 0)
    assert m.get_computed_blocks(lora_request("a2", range(9), "a")) == ([0, 1], 8)


def test_salt_and_adapter_both_key_the_blocks():
    m = KVCacheManager(16, BS)
    cache_first(m, lora_request("a1", range(9), "a", salt="tenant-1"))
    assert m.get_computed_blocks(lora_request("x", range(9), "a")) == ([], 0)
    assert m.get_computed_blocks(lora_request("y", range(9), "a", salt="tenant-2")) == ([], 0)
    assert m.get_computed_blocks(lora_request("z", range(9), None, salt="tenant-1")) == ([], 0)
    hit = m.get_computed_blocks(lora_request("w", range(9), "a", salt="tenant-1"))
    assert hit == ([0, 1], 8)


def test_base_model_blocks_are_not_served_to_an_adapter():
    m = KVCacheManager(16, BS)
    cache_first(m, lora_request("base", range(9), None))
    assert m.get_computed_blocks(lora_request("a1", range(9), "a")) == ([], 0)
    assert m.get_computed_blocks(lora_request("base2", range(9), None)) == ([0, 1], 8)


def make_scheduler(max_loras: int | None) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_queue_len=64)
    return Scheduler(cfg, KVCacheManager(64, BS), 256, max_loras=max_loras)


def test_a_third_adapter_waits_for_a_slot_without_blocking_the_queue():
    s = make_scheduler(max_loras=2)
    reqs = [
        lora_request("a", range(100, 105), "a", max_tokens=2),
        lora_request("b", range(200, 205), "b", max_tokens=6),
        lora_request("c", range(300, 305), "c"),
        lora_request("base", range(400, 405), None),
        lora_request("a-again", range(500, 505), "a"),
    ]
    for r in reqs:
        s.add_request(r)
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"a", "b", "base", "a-again"}
    assert s.adapter_counts() == ({"a": 2, "b": 1}, {"c": 1})
    assert [r.request_id for r in s.waiting] == ["c"]  # kept its place
    # "a" finishes after its second token, "a-again" still runs adapter a: c keeps waiting.
    for _ in range(2):
        s.update_from_output(so, fake_runner_output(s, so))
        so = s.schedule()
    assert "c" not in so.num_scheduled_tokens and not s.get_request("a")
    assert s.uses_adapter("a") and not s.uses_adapter("z")
    while s.get_request("a-again") is not None:
        s.update_from_output(so, fake_runner_output(s, so))
        so = s.schedule()
    assert "c" in so.num_scheduled_tokens  # adapter a is gone: c takes its slot
    assert len({s.get_request(r).lora_key for r in so.num_scheduled_tokens} - {None}) <= 2


def test_without_a_limit_every_adapter_runs():
    s = make_scheduler(max_loras=None)
    for i, name in enumerate("abc"):
        s.add_request(lora_request(name, range(10 * i, 10 * i + 5), name))
    assert set(s.schedule().num_scheduled_tokens) == {"a", "b", "c"}
