"""KV sizing's profiling step asks for the real peaks (issue 14, defect 6): prompt logprobs
over the whole token budget, their logits computed in bounded chunks, and a top-p sampler
pass over max_num_seqs rows. Runs on the CPU: only the peak measurement around it is CUDA's."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import SchedulerConfig
from engine.worker.kv_sizing import profile_kv_blocks, profile_requests, profile_step
from engine.worker.sampler import PROMPT_LOGPROBS_CHUNK, Sampler


class Recorder:
    """Wraps the runner's model.compute_logits and sampler to record row counts."""

    def __init__(self, runner) -> None:
        self.logit_rows: list[int] = []
        self.sampler_calls: list[tuple[int, list]] = []
        model, sampler = runner.model, runner.sampler
        self._undo = (runner, model, model.compute_logits, sampler)

        def compute_logits(hidden, keep_dtype=False):
            self.logit_rows.append(hidden.shape[0])
            return type(model).compute_logits(model, hidden, keep_dtype)

        class _Sampler(Sampler):
            def __call__(_, logits, rows, grammar_bitmask=None):
                self.sampler_calls.append((logits.shape[0], list(rows)))
                return sampler(logits, rows, grammar_bitmask)

        model.compute_logits = compute_logits
        runner.sampler = _Sampler()

    def restore(self) -> None:
        runner, model, _, sampler = self._undo
        del model.compute_logits
        runner.sampler = sampler


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    path = tiny_checkpoint("llama", max_position_embeddings=1024)
    return LLM(str(path), num_kv_blocks=256, block_size=16, dtype="float32",
               max_model_len=1024, max_num_batched_tokens=1024)  # fmt: skip


def test_prompt_logprob_logits_are_computed_in_bounded_chunks(llm):
    runner = llm.engine.runner
    rec = Recorder(runner)
    try:
        n = 2 * PROMPT_LOGPROBS_CHUNK + 37
        prompt = [(7 * i) % 400 + 3 for i in range(n)]
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2),
                           use_tqdm=False)  # fmt: skip
    finally:
        rec.restore()
    assert max(rec.logit_rows) <= PROMPT_LOGPROBS_CHUNK
    # Every prompt token after the first is scored, in order, as one unchunked pass would.
    scored = out[0].prompt_logprobs
    assert scored[0] is None and len(scored) == n
    assert [e.token_id for e in scored[1:]] == prompt[1:]
    assert all(e.logprob <= 0.0 and len(e.top) == 2 for e in scored[1:])


def test_profile_step_scores_every_prompt_token_and_samples_top_p_at_max_num_seqs(llm):
    runner = llm.engine.runner
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024)
    lens = profile_requests(sched, 1024)
    assert len(lens) == 64
    saved = runner.kv_caches
    rec = Recorder(runner)
    try:
        runner.allocate_kv_cache(profile_kv_blocks(sched, 16, 1024))
        profile_step(runner, sched, 16, 1024)
    finally:
        rec.restore()
        runner.kv_caches = saved
    # Prompt logprobs of each request's tokens (all but its last), in bounded chunks.
    assert sum(rec.logit_rows) == sum(n - 1 for n in lens) + len(lens)  # + the sampled rows
    assert max(rec.logit_rows) <= max(PROMPT_LOGPROBS_CHUNK, len(lens))
    rows, params = zip(*[(n, r[0].params) for n, r in rec.sampler_calls], strict=True)
    assert rows[-1] == sched.max_num_seqs  # the widest decode step's sampler pass
    assert all(p.top_p < 1.0 and p.temperature > 0 and p.prompt_logprobs for p in params)
    assert not [r for r in runner.states if r.startswith("profile-")]  # all finished
