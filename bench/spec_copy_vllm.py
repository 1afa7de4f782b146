"""The vLLM CPU side of bench/spec_copy.py: the issue's peer, in the same run as ours.

One subprocess per vLLM method (bench/peers/vllm_spec_peer.py under the vLLM venv's python,
bench/peers/setup_vllm.py; the bench/peers/base.py protocol through bench/throughput.py's
PeerProc), so vLLM's engine-core processes never share ours' process and each peer is loaded
once, then commanded one repeat at a time in spec_copy.py's rotated order. The same
checkpoint directory, the same prompt token ids (ours' chat template), the same max tokens,
greedy, float32, 2 threads.

`summarize` turns a method's repeats into spec_copy.py's record shape: median TPOT (the same
definition as ours: bench/peers/spec_timing.py), tok/s, TTFT, vLLM's own speculation counters
over the timed repeats, and its output compared with ours without speculation
(`equal_to_ours_none`, `first_divergence_vs_ours_none`) and with its own run without
speculation (`greedy_equal_to_none`, which must hold).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.common import median, rnd
from bench.peers.spec_timing import first_divergence, spec_summary

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "bench" / "peers" / "vllm_spec_peer.py"
# vLLM's own dict spelling, as the figures were measured with it.
VLLM_METHODS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
}


def entry_name(method: str) -> str:
    return f"vllm-{method}"


def start_peers(
    methods: list[str], model_dir: Path, prompt_ids: list[int], args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, str]]:
    """({entry: PeerProc ready to run}, {entry: why it is not}); installs the venv if missing
    unless --no-install. Loads all at once (vLLM compiles for a minute): nothing is timed."""
    from bench.throughput import PeerProc, peer_python

    pa = argparse.Namespace(
        threads=args.threads, kv_gib=1.0, verbose=args.verbose, timeout=args.vllm_timeout,
        vllm_python=args.vllm_python, no_install=args.no_install,
    )  # fmt: skip
    python, err = peer_python("vllm", pa)
    failed: dict[str, str] = {}
    if python is None:
        return {}, {entry_name(m): err or "no vLLM python" for m in methods}
    peers = {}
    for m in methods:
        spec = {
            "model": str(model_dir), "dtype": args.dtype, "threads": args.threads,
            "kv_cache_gib": 1.0, "max_model_len": args.max_model_len, "max_num_seqs": 4,
            "max_num_batched_tokens": args.max_model_len, "prompts": [prompt_ids],
            "max_tokens": [args.max_tokens], "repeats": args.repeats,
            "extra": {"speculative_config": VLLM_METHODS[m]},
        }  # fmt: skip
        try:
            peers[entry_name(m)] = PeerProc("vllm", python, spec, pa, PEER)
        except OSError as exc:
            failed[entry_name(m)] = f"cannot start {python}: {exc}"
    for name, p in list(peers.items()):
        if not p.wait_ready():
            failed[name] = p.error or "not ready"
            finish(p, failed, name)
            del peers[name]
    return peers, failed


def finish(peer: Any, failed: dict[str, str], name: str) -> dict[str, Any]:
    """Stop a peer; its result (load_s, versions, settings); a failure lands in `failed`."""
    res = peer.finish()
    if not res.get("ok"):
        failed.setdefault(name, (res.get("error") or "")[-1500:])
        failed[name + ".log_tail"] = (res.get("log_tail") or "")[-1500:]
    return res


def summarize(
    rs: list[dict[str, Any]], ours_none_ids: list[int] | None, vllm_none_ids: list[int] | None
) -> dict[str, Any]:
    """One vLLM method's repeats (the peer's run records) in spec_copy.py's record shape."""
    tpots = [x["tpot_ms"] for x in rs if x.get("tpot_ms") is not None]
    out: dict[str, Any] = {
        "tpot_ms": rnd(median(tpots), 2) if tpots else None,
        "tok_s": rnd(median(x["tok_s"] for x in rs), 2),
        "ttft_s": rnd(median(x["ttft_s"] for x in rs if x.get("ttft_s") is not None), 3)
        if any(x.get("ttft_s") is not None for x in rs) else None,
        "runs": len(rs),
        "tokens_all": [x["tokens"] for x in rs],
        "tpot_ms_all": [rnd(x.get("tpot_ms"), 2) for x in rs],
        "other_cores_all": [x.get("other_cores") for x in rs],
        "tpot_source": rs[0].get("tpot_source"),
        "greedy_equal_to_none": None if vllm_none_ids is None
        else all(x["ids"] == vllm_none_ids for x in rs),
        "equal_to_ours_none": None if ours_none_ids is None
        else all(x["ids"] == ours_none_ids for x in rs),
        "first_divergence_vs_ours_none": first_divergence(rs[0]["ids"], ours_none_ids),
    }  # fmt: skip
    first, last = rs[0].get("spec_before"), rs[-1].get("spec_after")
    if first is not None and last is not None:
        out.update(spec_summary(first, last))
    return out
