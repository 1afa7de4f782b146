"""Prefill-only (embedding) requests in the scheduler: chunked under the same budget, no
sample, finished when the runner returns their pooled vector, their blocks freed at once and
never registered in (nor read from) the prefix cache. Helpers live in
`tests/support/scheduler_helpers.py`.
"""

from __future__ import annotations

import pytest

from engine.core.request import Request, RequestStatus
from engine.core.step_io import RunnerOutput
from engine.errors import ContextLengthError, InvalidRequestError
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from tests.support.scheduler_helpers import fake_runner_output, make_request, make_scheduler, step


def embed_request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1), pooling_params=PoolingParams())


def pooled_step(sched, vectors: dict[str, list[float]] | None = None):
    """Schedules, then answers as an embedding runner: a vector for every prefill-only
    request whose prompt is computed after this step."""
    so = sched.schedule()
    out = fake_runner_output(sched, so)  # samples for generation requests
    keep = [i for i, rid in enumerate(out.req_ids) if not sched.get_request(rid).prefill_only]
    out.req_ids = [out.req_ids[i] for i in keep]
    out.sampled_token_ids = [out.sampled_token_ids[i] for i in keep]
    for rid in so.num_scheduled_tokens:
        req = sched.get_request(rid)
        if req is not None and req.prefill_only and req.num_computed_tokens == req.num_tokens:
            out.pooled[rid] = (vectors or {}).get(rid, [1.0, 0.0])
    return so, sched.update_from_output(so, out)


def test_prefill_only_request_is_chunked_then_finishes_when_pooled_with_its_blocks_freed():
    sched = make_scheduler(max_num_batched_tokens=4)
    r = embed_request("e", list(range(100, 110)))
    sched.add_request(r)
    for expected in (4, 4):
        so, updated = pooled_step(sched)
        assert so.num_scheduled_tokens == {"e": expected} and updated == []
        assert so.scheduled_new_reqs == [] or so.scheduled_new_reqs[0].pooling_params is not None
    so, updated = pooled_step(sched)
    assert so.num_scheduled_tokens == {"e": 2}
    assert updated == [r] and r.status is RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [] and r.times.first_token is None
    kv = sched.kv_manager
    assert kv.num_free_blocks == kv.num_blocks and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"e"}  # the runner drops its state


def test_prefill_only_request_gets_no_token_once_its_prompt_is_scheduled():
    """Until the runner answers, a computed prompt schedules nothing more (no decode)."""
    sched = make_scheduler()
    sched.add_request(embed_request("e", list(range(100, 106))))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"e": 6}
    assert sched.schedule().num_scheduled_tokens == {}


def test_prefill_only_blocks_are_never_cached_nor_read_from_the_cache():
    sched = make_scheduler()
    prompt = list(range(100, 112))  # 3 full blocks of 4
    sched.add_request(embed_request("e1", prompt))
    pooled_step(sched)
    assert sched.kv_manager.pool.num_cached_blocks == 0
    # A generation request with the same prompt fills the cache; an embedding of it then
    # still computes every token (pooling needs every hidden state).
    sched.add_request(make_request("g", prompt, max_tokens=1))
    step(sched)
    assert sched.kv_manager.pool.num_cached_blocks == 3
    sched.add_request(embed_request("e2", prompt))
    so, _ = pooled_step(sched)
    assert so.num_scheduled_tokens == {"e2": 12}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert sched.get_request("e2") is None  # finished in that step
    assert sched.kv_manager.pool.num_cached_blocks == 3  # only the generation's


def test_prefill_only_prompt_may_fill_the_whole_context_but_not_more():
    sched = make_scheduler(max_model_len=12, num_blocks=64)
    sched.add_request(embed_request("full", list(range(100, 112))))  # == max_model_len
    with pytest.raises(ContextLengthError, match="maximum context length is 12"):
        sched.add_request(embed_request("over", list(range(100, 113))))
    small = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(InvalidRequestError, match="need 3 KV blocks"):
        small.add_request(embed_request("big", list(range(100, 109))))


def test_preempted_prefill_only_request_recomputes_from_token_zero():
    """A generation request grows into the last free block: the embedding mid-prompt (the
    newest) is preempted, and later recomputes its prompt from token 0 (its partial pooling
    state went with the runner's state)."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=5)
    g = make_request("g", 4, max_tokens=12)
    e = embed_request("e", list(range(200, 212)))  # 3 blocks
    sched.add_request(g)
    sched.add_request(e)
    so, _ = pooled_step(sched)  # g's prompt (1 block), e's first token (1 block)
    assert so.num_scheduled_tokens == {"g": 4, "e": 1}
    so, _ = pooled_step(sched)  # g's 1st decode (a 2nd block), e's next 4 (a 2nd block)
    assert so.num_scheduled_tokens == {"g": 1, "e": 4}
    so, _ = pooled_step(sched)  # e needs a 3rd block: none free, so e (newest) yields
    assert so.preempted_req_ids == {"e"} and e.num_preemptions == 1
    assert e.num_computed_tokens == 0 and e.status is RequestStatus.PREEMPTED
    sched.abort("g")  # room again
    so, updated = pooled_step(sched)
    (new,) = so.scheduled_new_reqs
    assert (new.request_id, new.num_computed_tokens) == ("e", 0)
    assert so.num_scheduled_tokens == {"e": 5}


def test_pooled_vector_of_an_aborted_request_is_dropped():
    sched = make_scheduler()
    sched.add_request(embed_request("e", list(range(100, 106))))
    so = sched.schedule()
    sched.abort("e")
    assert sched.update_from_output(so, RunnerOutput(pooled={"e": [1.0]})) == []
    assert sched.kv_manager.num_free_blocks == sched.kv_manager.num_blocks
