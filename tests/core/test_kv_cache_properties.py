"""Random schedules against KVCacheManager, checked against a shadow KV cache.

A tiny simulated runner writes each scheduled token id into the slot the block table gives
it (after applying copy-on-writes), so "the KV of every computed token is in the request's
table" can be checked exactly: a wrong prefix hit, a missed copy-on-write or a block given
to two owners all show up as a wrong token in a slot.
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams

MAX_TOKENS = 24

_tok = st.integers(0, 2)  # a tiny vocabulary, so prefixes collide and hits are frequent
# Weighted by repetition: steps dominate, as in a real engine.
KINDS = (
    ["add", "add", "add_shared"]
    + ["step"] * 8
    + ["fork"] * 2
    + ["preempt", "finish", "abort_same_step"]
)
KINDS += ["reset"]
# (kind, which request, token budget, sampled token, prompt for "add")
OPS = st.tuples(
    st.sampled_from(KINDS),
    st.integers(0, 1000),
    st.integers(1, 8),
    _tok,
    st.lists(_tok, min_size=1, max_size=12),
)


class Sim:
    """The manager plus a scheduler and runner reduced to what the cache needs."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool):
        self.m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.live: list[Request] = []
        self.slots: dict[int, list[int | None]] = {
            i: [None] * block_size for i in range(num_blocks)
        }
        self.next_id = 0
        self.seen: list[list[int]] = []  # token ids of every request so far

    def add(self, tokens: list[int]) -> Request:
        req = Request(f"r{self.next_id}", tokens, SamplingParams())
        self.next_id += 1
        self.live.append(req)
        return req

    def pick(self, i: int) -> Request | None:
        return self.live[i % len(self.live)] if self.live else None

    def snapshot(self):
        pool = self.m.pool
        return (
            [b.block_id for b in pool.free_queue],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {r.request_id: self.m.get_block_ids(r.request_id) for r in self.live},
            self.m.stats(),
        )

    def allocate(self, req: Request, max_new: int) -> tuple[int, int] | None:
        """Schedule up to max_new tokens; the write range, or None if it did not fit."""
        hit_ids: list[int] = []
        hit_tokens = 0
        if not self.m.get_block_ids(req.request_id):
            hit_ids, hit_tokens = self.m.get_computed_blocks(req)
            assert hit_tokens < req.num_tokens
        start = req.num_computed_tokens + hit_tokens
        n = min(max_new, req.num_tokens - start)
        before = self.snapshot()
        if self.m.allocate_slots(req, n, hit_ids) is None:
            after = self.snapshot()
            assert after[:3] == before[:3] and after[3].evictions == before[3].evictions
            assert self.m.take_block_copies() == []
            return None
        for copy in self.m.take_block_copies():
            assert copy.request_id == req.request_id
            assert self.m.get_block_ids(req.request_id)[copy.index] == copy.dst
            self.slots[copy.dst] = list(self.slots[copy.src])
        return start, start + n

    def write(self, req: Request, start: int, end: int) -> None:
        table = self.m.get_block_ids(req.request_id)
        for pos in range(start, end):
            self.slots[table[pos // self.bs]][pos % self.bs] = req.all_token_ids[pos]
        req.num_computed_tokens = end

    def step(self, req: Request, max_new: int, sampled: int) -> None:
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids([sampled])
        rng = self.allocate(req, max_new)
        if rng is not None:
            self.write(req, *rng)

    def fork(self, parent: Request, k: int, sampled: int) -> None:
        if not self.m.get_block_ids(parent.request_id) or parent.num_computed_tokens == 0:
            return
        k = 1 + k % parent.num_computed_tokens
        child = self.add(parent.all_token_ids[:k])
        assert len(self.m.fork(parent, child, k)) == -(-k // self.bs)
        child.num_computed_tokens = k
        child.append_output_token_ids([sampled])

    def free(self, req: Request, finished: bool) -> None:
        self.seen.append(list(req.all_token_ids))
        self.m.free(req)
        req.num_computed_tokens = 0
        if finished:
            self.live.remove(req)

    def check(self) -> None:
        pool = self.m.pool
        tables = {r.request_id: self.m.get_block_ids(r.request_id) for r in self.live}
        holders = [0] * pool.num_blocks
        for table in tables.values():
            for block_id in table:
                holders[block_id] += 1
        queue = [b.block_id for b in pool.free_queue]
        assert len(queue) == len(set(queue)) == self.m.num_free_blocks
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id] >= 0
            in_queue = block.prev_free is not None
            assert in_queue == (block.ref_cnt == 0)
            assert (block.next_free is not None) == in_queue
        assert sum(1 for b in pool.blocks if b.ref_cnt == 0) == len(queue)
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash
        assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached_blocks)
        for req in self.live:
            table = tables[req.request_id]
            assert len(table) * self.bs >= req.num_computed_tokens
            for pos in range(req.num_computed_tokens):
                slot = self.slots[table[pos // self.bs]][pos % self.bs]
                assert slot == req.all_token_ids[pos], (req, pos)


# Found by this test: a forked child left alone in a block its parent filled and
# registered wrote into it in place, so a later prompt hit the child's token.
_ADD, _STEP = ("add", 0, 1, 0, [0]), ("step", 0, 1, 0, [0])
_FORK_FREE_WRITE = (
    [_ADD] * 3 + [_STEP] * 4 + [("fork", 0, 1, 1, [0])] + [_ADD] * 7
    + [_STEP, ("preempt", 0, 1, 0, [0]), ("step", 146, 1, 0, [0]), _ADD, _STEP]
)  # fmt: skip


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4]),
    caching=st.booleans(),
    ops=st.lists(OPS, min_size=20, max_size=80),
)
@example(num_blocks=2, block_size=4, caching=True, ops=_FORK_FREE_WRITE)
def test_random_schedules_keep_refs_queue_cache_and_contents_consistent(
    num_blocks, block_size, caching, ops
):
    sim = Sim(num_blocks, block_size, caching)
    for kind, which, budget, sampled, prompt in ops:
        if kind == "add":
            sim.add(prompt)
        elif kind == "add_shared" and sim.seen:
            # Start with a prefix of an earlier request: the case prefix caching is for.
            earlier = sim.seen[which % len(sim.seen)]
            sim.add(earlier[: 1 + which % len(earlier)] + prompt)
        elif kind == "reset":
            assert sim.m.reset_prefix_cache()
        elif (req := sim.pick(which)) is None:
            continue
        elif kind == "step":
            if req.num_tokens >= MAX_TOKENS:
                sim.free(req, finished=True)
            else:
                sim.step(req, budget, sampled)
        elif kind == "fork":
            sim.fork(req, budget, sampled)
        elif kind == "preempt":
            sim.free(req, finished=False)
        elif kind == "finish":
            sim.free(req, finished=True)
        elif kind == "abort_same_step":
            if req.num_computed_tokens < req.num_tokens:
                sim.allocate(req, budget)  # scheduled, then freed before the forward
            sim.free(req, finished=False)
        sim.check()
    for req in list(sim.live):
        sim.free(req, finished=True)
    sim.check()
    pool = sim.m.pool
    assert sim.m.num_free_blocks == num_blocks and sim.m.usage == 0.0
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sim.m._reqs == {}  # no per-request state left behind
