"""Per-tenant limits at admission, in the torch-free core: `max_queued` refuses that tenant
only; a full global queue pushes out the most over-share tenant's last request instead of
refusing another tenant (one tenant: refused as before); `tokens_per_minute` reserves
prompt + max_tokens, refuses with the seconds until the bucket refills, and gives back
what a finished request did not use. A fake clock drives the token buckets."""

from __future__ import annotations

import pytest

from engine.core.policy.tenant import Tenant
from engine.core.request import RequestStatus
from engine.errors import (
    InvalidRequestError,
    QueueFullError,
    TenantQueueFullError,
    TokenRateLimitError,
)
from tests.support.scheduler_helpers import FakeClock, make_request, make_scheduler, step


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_max_queued_refuses_that_tenant_only(policy):
    a, b = Tenant("a", max_queued=2), Tenant("b")
    sched = make_scheduler(policy=policy)
    sched.add_request(make_request("a0", tenant=a))
    sched.add_request(make_request("a1", tenant=a))
    with pytest.raises(TenantQueueFullError, match="tenant 'a' already has 2 requests waiting"):
        sched.add_request(make_request("a2", tenant=a))
    sched.add_request(make_request("b0", tenant=b))  # the other tenant is admitted
    assert sched.get_request("a2") is None and sched.num_waiting == 3
    step(sched)  # a0, a1 leave the queue: a may queue again
    sched.add_request(make_request("a2", tenant=a))


def test_tenant_refusals_are_queue_full_errors_with_their_own_codes():
    assert issubclass(TenantQueueFullError, QueueFullError)
    assert TenantQueueFullError.code == "tenant_queue_full"
    assert TokenRateLimitError.code == "tokens_per_minute_exceeded"
    assert QueueFullError("x").retry_after_s == 1.0


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair", "deadline"])
def test_a_full_queue_pushes_out_the_flooding_tenants_last_request(policy):
    flood, other = Tenant("flood"), Tenant("other")
    sched = make_scheduler(policy=policy, max_queue_len=4)
    for i in range(4):
        sched.add_request(make_request(f"f{i}", arrival=float(i), tenant=flood))
    sched.add_request(make_request("o0", arrival=10.0, tenant=other))
    ((pushed, err),) = sched.take_dropped()
    assert pushed.request_id == "f3" and pushed.status is RequestStatus.FINISHED_ERROR
    assert isinstance(err, QueueFullError) and "tenant 'flood'" in str(err)
    assert sorted(r.request_id for r in sched.waiting) == ["f0", "f1", "f2", "o0"]
    # The flood at 3 queued, the other at 1: the flood's next arrival is refused itself.
    with pytest.raises(QueueFullError, match="queue is full"):
        sched.add_request(make_request("f4", arrival=11.0, tenant=flood))
    # The other tenant may keep pushing until both hold an equal share (2 and 2).
    sched.add_request(make_request("o1", arrival=12.0, tenant=other))
    assert [r.request_id for r, _ in sched.take_dropped()] == ["f2"]
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("o2", arrival=13.0, tenant=other))


def test_weights_set_the_queue_shares_too():
    heavy, light = Tenant("heavy", weight=3), Tenant("light", weight=1)
    sched = make_scheduler(policy="fair", max_queue_len=4)
    for i in range(3):
        sched.add_request(make_request(f"h{i}", arrival=float(i), tenant=heavy))
    sched.add_request(make_request("l0", arrival=5.0, tenant=light))
    # Full: heavy 3/3 = 1 per weight, light (1+1)/1 = 2: the light arrival is refused.
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("l1", arrival=6.0, tenant=light))
    assert sched.take_dropped() == []


def test_with_one_tenant_a_full_queue_refuses_as_before():
    sched = make_scheduler(max_queue_len=2)
    sched.add_request(make_request("a"))
    sched.add_request(make_request("b"))
    with pytest.raises(QueueFullError, match="the waiting queue is full"):
        sched.add_request(make_request("c"))
    assert sched.take_dropped() == [] and sched.num_waiting == 2


def test_tokens_per_minute_reserves_refuses_with_retry_after_and_refills():
    clock = FakeClock()
    t = Tenant("t", tokens_per_minute=100)
    sched = make_scheduler(clock=clock)
    for i in range(4):  # 8 prompt + 16 max_tokens = 24 each: 96 of 100
        sched.add_request(make_request(f"r{i}", 8, 16, tenant=t))
    with pytest.raises(TokenRateLimitError) as e:
        sched.add_request(make_request("r4", 8, 16, tenant=t))
    assert e.value.retry_after_s == pytest.approx((24 - 4) * 60 / 100)
    assert sched.get_request("r4") is None
    sched.add_request(make_request("u0", 8, 16))  # the default tenant has no rate
    clock.advance(12.0)  # 100/60 tokens a second: 4 + 20 = 24 again
    sched.add_request(make_request("r4", 8, 16, tenant=t))


def test_tokens_per_minute_gives_back_what_a_finished_request_did_not_use():
    clock = FakeClock()
    t = Tenant("t", tokens_per_minute=60)
    sched = make_scheduler(clock=clock)
    sched.add_request(make_request("used", 8, 16, tenant=t, eos=99))  # reserves 24
    sched.add_request(make_request("never", 8, 16, tenant=t))  # reserves 24: 12 left
    sched.abort("never")  # never scheduled: all 24 back (36)
    step(sched)  # "used" prefills and samples 1 token
    sched.stop_on_string(sched.get_request("used"), "stop")  # used 8 + 1 = 9: 15 back (51)
    sched.add_request(make_request("a", 8, 16, tenant=t))  # 51 - 24 = 27
    sched.add_request(make_request("b", 8, 16, tenant=t))  # 3 left
    with pytest.raises(TokenRateLimitError) as e:
        sched.add_request(make_request("c", 8, 16, tenant=t))
    assert e.value.retry_after_s == pytest.approx(21.0)  # 21 tokens at 1 a second


def test_a_reservation_larger_than_the_whole_bucket_is_a_bad_request():
    sched = make_scheduler(clock=FakeClock())
    with pytest.raises(InvalidRequestError, match="more than tenant 't' may use") as e:
        sched.add_request(make_request("big", 8, 100, tenant=Tenant("t", tokens_per_minute=50)))
    assert e.value.param == "max_tokens"


def test_bad_tenant_fields_are_refused_naming_the_field():
    for kw, field in (
        ({"weight": 0}, "tenant.weight"),
        ({"weight": -1.5}, "tenant.weight"),
        ({"weight": float("inf")}, "tenant.weight"),
        ({"max_running": 0}, "tenant.max_running"),
        ({"max_queued": 1.5}, "tenant.max_queued"),
        ({"tokens_per_minute": True}, "tenant.tokens_per_minute"),
        ({"name": ""}, "tenant.name"),
    ):
        with pytest.raises(ValueError, match=field):
            Tenant(**{"name": "x", **kw})
