"""Plots and the latest-results tables from bench/results/*.jsonl.

Writes into bench/results/:

- throughput.png: generated tokens/s by engine for each (model, workload, dtype), from the
  latest full (non --quick) run of bench/throughput.py for that triple, with the ours/peer
  ratios; one row of panels per (model, workload), one column per dtype; failed peers are
  marked, not dropped.
- serving_latency.png: TTFT and ITL (p50, p90) and output tokens/s by load (concurrency),
  from the latest run in bench/results/serving.jsonl (bench/serving.py), if present.
- prefix_ttft.png: mean TTFT with prefix caching off/on (bench/prefix_ttft.py), if present.
- serving_vs.png: ours vs vLLM's server under Poisson arrivals (bench/serving_vs.py), see
  bench/plot_serving_vs.py, if present.
- summary.md: markdown tables of the latest throughput (with bf16 / fp32 per engine),
  serving-vs-vLLM, prefix-TTFT, KV and MFU results.

`--update-docs` also replaces the block between `<!-- bench:begin -->` and
`<!-- bench:end -->` in docs/benchmarks.md with summary.md.

    python bench/plot.py [--update-docs] [--include-quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import plot_serving_vs  # noqa: E402
from bench.common import RESULTS_DIR, isa_line, log, machines_line, read_jsonl  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
ENGINE_ORDER = ("ours", "vllm", "transformers")
COLORS = {"ours": "#1f77b4", "vllm": "#ff7f0e", "transformers": "#2ca02c"}


def latest_throughput(include_quick: bool) -> list[dict[str, Any]]:
    recs = [
        r for r in read_jsonl(RESULTS_DIR / "throughput.jsonl") if r.get("bench") == "throughput"
    ]
    if not include_quick:
        full = [r for r in recs if not r.get("quick")]
        recs = full or recs
    latest: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in recs:  # file order is time order; records before --dtypes were float32
        latest[(r["model"], r["workload"]["workload"], dtype_of(r))] = r
    return list(latest.values())


def dtype_of(rec: dict[str, Any]) -> str:
    return rec.get("dtype", "float32")


def plot_throughput(recs: list[dict[str, Any]], out: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not recs:
        return False
    rows = list(dict.fromkeys((r["model"], r["workload"]["workload"]) for r in recs))
    cols = list(dict.fromkeys(dtype_of(r) for r in recs))
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(max(7.0, 4.6 * len(cols)),
                             4.4 * len(rows)), squeeze=False)  # fmt: skip
    for ax in axes.flat:
        ax.set_visible(False)
    for rec in recs:
        row = rows.index((rec["model"], rec["workload"]["workload"]))
        ax = axes[row][cols.index(dtype_of(rec))]
        ax.set_visible(True)
        engines = [e for e in ENGINE_ORDER if e in rec["engines"]]
        vals = [rec["engines"][e].get("tok_s") or 0 for e in engines]
        bars = ax.bar(engines, vals, color=[COLORS.get(e, "grey") for e in engines])
        for b, e in zip(bars, engines, strict=True):
            r = rec["engines"][e]
            if not r.get("ok"):
                label = "failed"
            else:
                ratio = rec.get("ratios", {}).get(f"ours/{e}")
                label = f"{r['tok_s']:.0f}" + (f"\n(ours {ratio:.2f}x)" if ratio else "")
                runs = r.get("tok_s_all") or []
                ax.plot([b.get_x() + b.get_width() / 2] * len(runs), runs, "k.", ms=5,
                        label="single runs" if e == engines[0] else None)  # fmt: skip
            ax.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8)  # fmt: skip
        other = [
            rec["engines"][e].get("other_cores") for e in engines if rec["engines"][e].get("ok")
        ]
        ax.set_title(f"{rec['model']} / {rec['workload']['workload']} / {dtype_of(rec)}\n"
                     f"{rec['date'][:10]}, others' load {other} cores", fontsize=9)  # fmt: skip
        ax.set_ylabel("generated tokens/s (bar: median)")
        tops = vals + [max(rec["engines"][e].get("tok_s_all") or [0]) for e in engines]
        ax.set_ylim(0, max(tops + [1]) * 1.3)
        ax.legend(loc="upper right", fontsize=7)
    m = max(recs, key=lambda r: r["date"]).get("machine", {})
    differ = len({isa_line(r.get("machine", {})) for r in recs}) > 1
    fig.suptitle(f"Offline throughput, {isa_line(m)}"
                 f"{' (latest; machines differ, see summary.md)' if differ else ''}\n"
                 f"{recs[0]['settings'].get('threads')} threads, median of "
                 f"{recs[0]['settings'].get('repeats')} runs", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def plot_serving(out: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in read_jsonl(RESULTS_DIR / "serving.jsonl")
            if r.get("mode") == "http" and "concurrency" in r]  # fmt: skip
    if not recs:
        return False
    last_time = recs[-1].get("time")
    recs = sorted((r for r in recs if r.get("time") == last_time), key=lambda r: r["concurrency"])
    x = [r["concurrency"] for r in recs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "ITL")):
        for q, style in (("p50", "o-"), ("p90", "s--")):
            ax.plot(x, [r[key].get(q) for r in recs], style, label=q)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    axes[2].plot(x, [r.get("output_tok_per_s") for r in recs], "o-")
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("concurrent clients")
    axes[2].set_ylabel("output tokens/s")
    axes[2].set_title("throughput")
    other = [r.get("other_cpu_cores") for r in recs]
    fig.suptitle(f"HTTP serving (bench/serving.py), {last_time}, max_tokens "
                 f"{recs[0].get('max_tokens')}, others' load by level {other} cores", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def plot_prefix(out: Path) -> dict[str, Any] | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_jsonl(RESULTS_DIR / "prefix_ttft.jsonl")
    if not recs:
        return None
    rec = recs[-1]
    modes = [m for m, row in rec["ttft"].items() if "speedup" in row]
    if not modes:
        return rec
    fig, ax = plt.subplots(figsize=(5.5, 4))
    width = 0.38
    for i, key in enumerate(("off", "on")):
        vals = [rec["ttft"][m][key]["mean_ms"] for m in modes]
        xs = [j + (i - 0.5) * width for j in range(len(modes))]
        ax.bar(xs, vals, width, label=f"prefix caching {key}")
        for xx, v in zip(xs, vals, strict=True):
            ax.annotate(f"{v:.0f}", (xx, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels([f"{m}\n({rec['ttft'][m]['speedup']}x)" for m in modes])
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_yscale("log")
    w = rec["workload"]
    ax.set_title(
        f"{rec['model']}: {w['requests']} requests sharing a {w['prefix_len']}-token prefix",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return rec


def fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def throughput_md(tp: list[dict[str, Any]]) -> list[str]:
    """Markdown: tok/s per engine and dtype, ours/peer ratios, bf16 / fp32, our split."""
    if not tp:
        return []
    lines = [
        f"{machines_line(tp)}; threads {tp[0]['settings'].get('threads')}. `other cores` = "
        f"cores other processes kept busy during the timed runs (shared box).",
        "",
        "| model | workload | dtype | engine | tok/s median | best | runs | other cores | ours / engine, median (best) | load s |",
        "|---|---|---|---|---:|---:|---|---|---:|---:|",
    ]  # fmt: skip
    for rec in tp:
        where = f"| {rec['model']} | {rec['workload']['workload']} | {dtype_of(rec)} |"
        for e in ENGINE_ORDER:
            r = rec["engines"].get(e)
            if r is None:
                continue
            if not r.get("ok"):
                err = (r.get("error") or "failed").strip().splitlines()[0][:80]
                lines.append(f"{where} {e} | failed: {err} | | | | | |")
                continue
            ratio = rec.get("ratios", {}).get(f"ours/{e}")
            best = max(r["tok_s_all"])
            ours_best = max(rec["engines"]["ours"]["tok_s_all"]) if ratio else None
            rtxt = f"{ratio:.2f} ({ours_best / best:.2f})" if ratio else ""
            lines.append(f"{where} {e} | {fmt(r['tok_s'])} | {fmt(best)} | {r['tok_s_all']} | "
                         f"{r['other_cores_all']} | {rtxt} | {fmt(r.get('load_s'))} |")  # fmt: skip
    lines.append("")
    lines += dtype_md(tp)
    splits = [(rec, rec["engines"].get("ours", {}).get("split")) for rec in tp]
    splits = [(rec, s) for rec, s in splits if s]
    if splits:
        lines += ["Our prefill/decode split (median run):", "",
                  "| model | workload | dtype | prefill s | prefill tok/s | decode s | decode tok/s | mean decode batch |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for rec, s in splits:
            lines.append(f"| {rec['model']} | {rec['workload']['workload']} | {dtype_of(rec)} | "
                         f"{fmt(s.get('prefill_s'), 2)} | {fmt(s.get('prefill_tok_s'), 0)} | "
                         f"{fmt(s.get('decode_s'), 2)} | {fmt(s.get('decode_tok_s'), 0)} | "
                         f"{fmt(s.get('mean_decode_batch'))} |")  # fmt: skip
        lines.append("")
    return lines


def dtype_md(tp: list[dict[str, Any]]) -> list[str]:
    """Markdown: each engine's tok/s in a non-fp32 dtype over its fp32 tok/s, both from the
    same invocation (the record's `vs_float32`)."""
    rows = []
    fp32 = {(r["run_id"], r["model"], r["workload"]["workload"]): r for r in tp
            if dtype_of(r) == "float32" and "run_id" in r}  # fmt: skip
    for rec in tp:
        base = fp32.get((rec.get("run_id"), rec["model"], rec["workload"]["workload"]))
        if not rec.get("vs_float32") or base is None:
            continue
        for e in ENGINE_ORDER:
            ratio = rec["vs_float32"].get(e)
            if ratio is None:
                continue
            a, b = base["engines"][e], rec["engines"][e]
            rows.append(f"| {rec['model']} | {rec['workload']['workload']} | {e} | {fmt(a['tok_s'])} | "
                        f"{dtype_of(rec)} | {fmt(b['tok_s'])} | {ratio:.2f} | "
                        f"{a['other_cores_all']} / {b['other_cores_all']} |")  # fmt: skip
    if not rows:
        return []
    return ["Each engine against itself in fp32 (same invocation, runs minutes apart):", "",
            "| model | workload | engine | fp32 tok/s | dtype | tok/s | / fp32 | other cores fp32 / dtype |",
            "|---|---|---|---:|---|---:|---:|---|", *rows, ""]  # fmt: skip


def summary_md(
    tp: list[dict[str, Any]], prefix: dict[str, Any] | None, include_quick: bool = False
) -> str:
    lines: list[str] = throughput_md(tp)
    lines += plot_serving_vs.table_md(include_quick)
    if prefix:
        lines += [f"Shared-prefix TTFT ({prefix['model']}, {prefix['workload']['requests']} requests, "
                  f"{prefix['workload']['prefix_len']}-token shared prefix, {prefix['date'][:10]}):", "",
                  "| mode | mean TTFT off (ms) | mean TTFT on (ms) | speed-up | other cores off / on |",
                  "|---|---:|---:|---:|---|"]  # fmt: skip
        for mode, row in prefix["ttft"].items():
            if "speedup" in row:
                lines.append(f"| {mode} | {row['off']['mean_ms']} | {row['on']['mean_ms']} | "
                             f"{row['speedup']}x | {row['off']['other_cores_all']} / {row['on']['other_cores_all']} |")  # fmt: skip
        lines.append("")
    kv = read_jsonl(RESULTS_DIR / "kv_metrics.jsonl")
    if kv:
        k = kv[-1]
        w, c = k["waste_w64"][0], k["concurrency"]
        lines += [
            f"KV cache ({k['date'][:10]}): W64 waste {100 * w['waste_of_pool']:.2f}% of the pool "
            f"({100 * w['waste_of_allocated']:.2f}% of allocated slots); for {c['budget_tokens']} KV slots, "
            f"{c['paged_mean_running_while_queued']} concurrent sequences on average (peak "
            f"{c['paged_peak_running']}) vs {c['contiguous_max_len_seqs']} with a {c['max_model_len']}-slot "
            f"contiguous reservation = {c['ratio_mean_vs_max_len']}x.",
            "",
        ]
    mfu = read_jsonl(RESULTS_DIR / "mfu.jsonl")
    if mfu:
        latest: dict[str, dict[str, Any]] = {}
        for r in mfu:
            latest[r["model"]] = r
        lines += ["| model | decode batch | decode tok/s | MFLOP/token | GFLOP/s | GEMM peak GFLOP/s | MFU | other cores (decode / GEMM) |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for r in latest.values():
            d = r["decode"]
            fl = (r["flops_per_token_matmul"] + r["flops_per_token_attention"]) / 1e6
            lines.append(f"| {r['model']} | {d.get('mean_decode_batch')} | {fmt(d.get('decode_tok_s'))} | {fl:.1f} | "
                         f"{r['achieved_gflops']} | {r['gemm']['peak_gflops']} | {100 * r['mfu']:.1f}% | "
                         f"{d.get('other_cores')} / {r['gemm'].get('other_cores')} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--include-quick", action="store_true", help="use --quick runs too")
    ap.add_argument(
        "--update-docs", action="store_true", help=f"rewrite the results block in {DOCS}"
    )
    args = ap.parse_args()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    tp = latest_throughput(args.include_quick)
    if plot_throughput(tp, RESULTS_DIR / "throughput.png"):
        log(f"wrote {RESULTS_DIR / 'throughput.png'}")
    if plot_serving(RESULTS_DIR / "serving_latency.png"):
        log(f"wrote {RESULTS_DIR / 'serving_latency.png'}")
    prefix = plot_prefix(RESULTS_DIR / "prefix_ttft.png")
    if prefix:
        log(f"wrote {RESULTS_DIR / 'prefix_ttft.png'}")
    if plot_serving_vs.plot(RESULTS_DIR / "serving_vs.png", args.include_quick):
        log(f"wrote {RESULTS_DIR / 'serving_vs.png'}")
    md = summary_md(tp, prefix, args.include_quick)
    (RESULTS_DIR / "summary.md").write_text(md + "\n")
    print(md)
    if args.update_docs:
        text = DOCS.read_text() if DOCS.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
            DOCS.write_text(f"{head}{BEGIN}\n{md}\n{END}{tail}")
            log(f"updated {DOCS}")
        else:
            log(f"{DOCS} has no {BEGIN} ... {END} block; not changed")


if __name__ == "__main__":
    main()
