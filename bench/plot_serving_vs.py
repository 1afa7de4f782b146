"""serving_vs.png and its markdown table, from bench/results/serving_vs.jsonl
(bench/serving_vs.py: ours against vLLM's server at Poisson arrival rates). Called by
bench/plot.py; the latest full (non --quick) run for each (model, dtype) is shown.

The figure has one column per (model, dtype) and five rows: output tokens/s, TTFT, ITL, TPOT
and end-to-end latency against the arrival rate (p50 solid, p99 dashed), both engines in
each panel. ITL is the gap between chunks as the client receives them: a server that sends
tokens in bursts shows near-zero gaps and long ones; TPOT (per request, time after the
first token / later tokens) is the per-token speed that does not depend on that.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, machines_line, read_jsonl  # noqa: E402

SOURCE = RESULTS_DIR / "serving_vs.jsonl"
ENGINES = ("ours", "vllm")
COLORS = {"ours": "#1f77b4", "vllm": "#ff7f0e"}
LATENCIES = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "end-to-end"))


def rate_key(rate: Any) -> float:
    return float("inf") if rate == "inf" else float(rate)


def rate_text(rate: Any) -> str:
    return rate if rate == "inf" else f"{float(rate):g}"


def latest(include_quick: bool = False) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(model, dtype) -> the rows of the latest run that measured that pair."""
    rows = [r for r in read_jsonl(SOURCE) if r.get("bench") == "serving_vs"]
    if not include_quick:
        rows = [r for r in rows if not r.get("quick")] or rows
    last_run: dict[tuple[str, str], str] = {}
    for r in rows:  # file order is time order
        last_run[(r["model"], r["dtype"])] = r["run_id"]
    return {
        pair: [r for r in rows if (r["model"], r["dtype"]) == pair and r["run_id"] == run]
        for pair, run in last_run.items()
    }


def plot(out: Path, include_quick: bool = False) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = latest(include_quick)
    if not runs:
        return False
    rows_n = 1 + len(LATENCIES)
    fig, axes = plt.subplots(rows_n, len(runs), figsize=(max(6.0, 5.0 * len(runs)), 3.2 * rows_n),
                             squeeze=False)  # fmt: skip
    for col, ((model, dtype), rows) in enumerate(runs.items()):
        rates = sorted({r["rate"] for r in rows if r.get("ok")}, key=rate_key)
        xs = range(len(rates))
        for engine in ENGINES:
            mine = {r["rate"]: r for r in rows if r["engine"] == engine and r.get("ok")}
            if not mine:
                failed = any(r["engine"] == engine and not r.get("ok") for r in rows)
                if failed:
                    axes[0][col].text(
                        0.02, 0.9, f"{engine}: failed", transform=axes[0][col].transAxes
                    )
                continue
            got = [mine.get(rate) for rate in rates]
            tok = [r["output_tok_per_s"] if r else None for r in got]
            axes[0][col].plot(xs, tok, "o-", color=COLORS[engine], label=engine)
            for row, (key, _) in enumerate(LATENCIES, start=1):
                for q, style in (("p50", "o-"), ("p99", "s--")):
                    ys = [r.get(key, {}).get(q) if r else None for r in got]
                    axes[row][col].plot(xs, ys, style, color=COLORS[engine], label=f"{engine} {q}")
        first = rows[0]
        axes[0][col].set_title(f"{model} / {dtype}, {first['date'][:16]}\n"
                               f"{first['workload']['num_requests']} requests per rate, "
                               f"max_tokens {first['max_tokens']}", fontsize=9)  # fmt: skip
        axes[0][col].set_ylabel("output tokens/s")
        for row, (_, name) in enumerate(LATENCIES, start=1):
            axes[row][col].set_ylabel(f"{name} ms (log)")
            axes[row][col].set_yscale("log")
        for ax in axes[:, col]:
            ax.set_xticks(list(xs))
            ax.set_xticklabels([rate_text(r) for r in rates])
            ax.set_xlabel("arrival rate (requests/s; inf = all at once)")
            ax.legend(fontsize=7)
    all_rows = [r for rows in runs.values() for r in rows]
    s = all_rows[0]["settings"]
    fig.suptitle(f"Serving vs vLLM (bench/serving_vs.py)\n{machines_line(all_rows)}\nthreads {s['threads']}, KV {s['kv_cache_gib']} GiB, "
                 f"max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens "
                 f"{s['max_num_batched_tokens']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def pair(pcts: dict[str, float | None], nd: int) -> str:
    """'p50 / p99' with nd decimals; a dash for a missing one (no ITL with one token)."""
    return " / ".join("—" if pcts.get(q) is None else f"{pcts[q]:.{nd}f}" for q in ("p50", "p99"))


def table_md(include_quick: bool = False) -> list[str]:
    runs = latest(include_quick)
    if not runs:
        return []
    first = next(iter(runs.values()))[0]
    s, w = first["settings"], first["workload"]
    lines = [
        f"Serving, ours vs vLLM's OpenAI server (`bench/serving_vs.py`, {first['date'][:10]}): "
        f"{w['num_requests']} requests per rate, prompts {w['prompt_len_min']}-"
        f"{w['prompt_len_max']} token ids, max_tokens {first['max_tokens']}, greedy, ignore_eos, "
        f"streamed, Poisson arrivals; both with KV {s['kv_cache_gib']} GiB, {s['threads']} "
        f"threads (vLLM `{s['binding']['vllm']}`), max_num_seqs {s['max_num_seqs']}, "
        f"max_num_batched_tokens {s['max_num_batched_tokens']}, max_model_len "
        f"{s['max_model_len']}, prefix caching {s['prefix_caching']}. "
        f"{machines_line([r for rows in runs.values() for r in rows])}.",
        "",
        "| model | dtype | rate /s | engine | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 / p99 ms | e2e p50 / p99 ms | other cores | ours / vLLM tok/s |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for (model, dtype), rows in runs.items():
        ok = {(r["engine"], r["rate"]): r for r in rows if r.get("ok")}
        for r in rows:
            if not r.get("ok"):
                err = (r.get("error") or "failed").splitlines()[0][:80]
                lines.append(
                    f"| {model} | {dtype} | | {r['engine']} | failed: {err} | | | | | | | |"
                )
        for rate in sorted({rate for _, rate in ok}, key=rate_key):
            for engine in ENGINES:
                r = ok.get((engine, rate))
                if r is None:
                    continue
                lat = [pair(r["ttft_ms"], 0), pair(r["e2e_ms"], 0)]
                itl, tpot = pair(r["itl_ms"], 1), pair(r.get("tpot_ms", {}), 1)
                peer = ok.get(("vllm", rate))
                ratio = ""
                if engine == "ours" and peer and peer["output_tok_per_s"]:
                    ratio = f"{r['output_tok_per_s'] / peer['output_tok_per_s']:.2f}"
                lines.append(f"| {model} | {dtype} | {rate_text(rate)} | {engine} | {r['req_per_s']:.2f} | "
                             f"{r['output_tok_per_s']:.1f} | {lat[0]} | {itl} | {tpot} | {lat[1]} | "
                             f"{r['other_cores']} | {ratio} |")  # fmt: skip
    return [*lines, ""]
