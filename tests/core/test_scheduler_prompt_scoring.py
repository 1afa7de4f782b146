"""Requests that score their prompt: `max_tokens=0` ends right after the prefill with no
output, and a request asking for prompt logprobs computes its whole prompt (no prefix-cache
read) while its blocks still serve the cache. Helpers live in
`tests/support/scheduler_helpers.py`.
"""

from __future__ import annotations

from engine.core.request import RequestStatus
from tests.support.scheduler_helpers import make_request, make_scheduler, step


def test_max_tokens_zero_finishes_after_a_chunked_prefill_with_no_output():
    sched = make_scheduler(max_num_batched_tokens=4)
    r = make_request("r", 10, max_tokens=0, prompt_logprobs=0)
    sched.add_request(r)
    for _ in range(2):  # chunks of 4 and 4 tokens: no sample yet
        so, updated = step(sched)
        assert updated == [] and not r.is_finished
    so, updated = step(sched)  # the last 2 prompt tokens; the sample is dropped
    assert so.num_scheduled_tokens == {"r": 2}
    assert updated == [r]
    assert (r.status, r.output_token_ids, r.stop_reason) == (
        RequestStatus.FINISHED_LENGTH,
        [],
        None,
    )
    assert not sched.has_unfinished_requests()
    assert sched.kv_manager.num_free_blocks == sched.kv_manager.num_blocks
    assert step(sched)[0].finished_req_ids == {"r"}  # the runner drops its state


def test_prompt_logprobs_request_reads_no_cached_block_but_feeds_the_cache():
    sched = make_scheduler()
    prompt = list(range(100, 110))  # 2 full blocks of 4 and 2 tokens
    sched.add_request(make_request("plain", prompt, max_tokens=1))
    step(sched)
    scoring = make_request("scoring", prompt, max_tokens=1, prompt_logprobs=1)
    sched.add_request(scoring)
    so, _ = step(sched)
    assert [(n.request_id, n.num_computed_tokens) for n in so.scheduled_new_reqs] == [
        ("scoring", 0)
    ]
    assert so.num_scheduled_tokens == {"scoring": 10} and scoring.num_cached_tokens == 0
    stats = sched.kv_manager.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (10, 0)  # no lookup counted for it

    # A scoring request's own full blocks are cached for the requests after it.
    sched = make_scheduler()
    sched.add_request(make_request("scoring", prompt, max_tokens=1, prompt_logprobs=1))
    step(sched)
    later = make_request("later", prompt, max_tokens=1)
    sched.add_request(later)
    so, _ = step(sched)
    assert [(n.request_id, n.num_computed_tokens) for n in so.scheduled_new_reqs] == [("later", 8)]
    assert later.num_cached_tokens == 8
