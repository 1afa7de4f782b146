"""The KV disk tier under tensor parallelism (TP=2, two processes on gloo): every rank saves
and loads its own heads' share of each block into a directory of its own, and the core
counts a move only once both ranks did it (engine/worker/kv_tier/rank_reports.py).

Greedy output with the tier equals TP=2 without it with a pool too small for the working
set (so returning turns are served from the tier); both ranks' directories hold the same
blocks; the drain's flush reaches every rank; a restart on the same directory serves the
returning turns from the tier again; a TP=1 engine on that directory finds nothing of ours.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine import LLM
from tests.engine.test_kv_tier_fidelity import SMALL_POOL, _conversations, _greedy, _two_turns
from tests.support.offline import run_to_finals


def _tp2(model_dir: Path, tier_dir: Path | None = None) -> LLM:
    return LLM(
        str(model_dir), tensor_parallel_size=2, **SMALL_POOL,
        disk_tier_dir=tier_dir and str(tier_dir),
    )  # fmt: skip


def _rank_files(tier_dir: Path) -> dict[int, set[str]]:
    """Each rank's block files, by the rank its fingerprint names."""
    out = {}
    for d in tier_dir.glob("kv-*"):
        rank = json.loads((d / "fingerprint.json").read_text())["tensor_parallel_rank"]
        out[rank] = {f.name for f in d.glob("??/*") if f.is_file()}
    return out


def test_tp2_serves_returning_turns_from_every_ranks_tier_and_again_after_a_restart(
    tiny_checkpoint, tmp_path, caplog
):
    model_dir = tiny_checkpoint("llama")  # two KV heads: one per rank
    firsts = _conversations()
    ref = _tp2(model_dir)
    try:
        want = _two_turns(ref, firsts)
    finally:
        ref.close()

    tier = tmp_path / "tier"
    llm = _tp2(model_dir, tier)
    try:
        assert _two_turns(llm, firsts) == want
        stats = llm.engine.stats()
        assert stats.kv_tier.hit_tokens["disk"] >= 4 * 24  # every returning turn read back
        assert stats.num_preemptions > 0
        run_to_finals(llm.engine)  # the last saves' copies come back in a step
        assert llm.engine.stats().num_free_blocks == 16
        before = _rank_files(tier)
        assert set(before) == {0, 1} and before[0] == before[1] and before[0]
        llm.engine.kv_tier.max_held = 0  # saving on free off: only the drain writes now
        llm.generate([{"prompt_token_ids": _conversations(1, seed=9)[0]}], _greedy())
        assert _rank_files(tier) == before
        flushed = llm.engine.flush_kv_tier(30.0)  # a step that computes nothing, every rank
        assert flushed == 7  # 26 + 6 tokens, 31 computed: 7 full blocks of 4
        files = _rank_files(tier)
        assert files[0] == files[1] and len(files[0]) == len(before[0]) + flushed
    finally:
        llm.close()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.worker.kv_tier.setup"):
        again = _tp2(model_dir, tier)
    assert "ignores" not in caplog.text  # the sibling rank's directory is not "another model"
    try:
        seconds = [p + a[0] + [7, 8, 9, 10] for p, a in zip(firsts, want[:4], strict=True)]
        out = again.generate([{"prompt_token_ids": p} for p in seconds[:1]], _greedy())
        assert out[0].outputs[0].token_ids == want[4][0]
        assert out[0].metrics.num_cached_tokens >= 24
        assert again.engine.stats().kv_tier.hit_tokens["disk"] >= 24
    finally:
        again.close()

    with caplog.at_level(logging.INFO, logger="engine.worker.kv_tier.setup"):
        tp1 = LLM(str(model_dir), **SMALL_POOL, disk_tier_dir=str(tier))
    assert "ignores 2 other fingerprint directories" in caplog.text
    out = tp1.generate([{"prompt_token_ids": seconds[0]}], _greedy())
    assert out[0].metrics.num_cached_tokens == 0  # another layout: not its files
