"""Plot ours vs llama.cpp's `llama-server` on the default GGUF (bench/serving_llamacpp.py).

One figure, two panels, from the rows of bench/results/serving_llamacpp.jsonl of one day
(`--date`, default: the newest row's) and of the newest row's commit: one-stream ITL p50 and 64-stream output tok/s per
engine, one dot per invocation and a bar at the median, so the spread between runs shows.

    python bench/plot_llamacpp.py            # writes bench/results/serving_llamacpp.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load(path: Path, date: str | None) -> tuple[list[dict], str]:
    """The rows of one day measured on one commit: the newest row's (a plot never mixes
    code versions)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("ok") and r.get("mode") in ("single", "concurrent")]
    day = date or max(r["date"][:10] for r in rows)
    rows = [r for r in rows if r["date"].startswith(day)]
    commit = max(rows, key=lambda r: r["date"])["git"].removesuffix("-dirty")
    return [r for r in rows if r["git"].removesuffix("-dirty") == commit], f"{day}, git {commit}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--date", default=None, help="YYYY-MM-DD (default: the newest)")
    ap.add_argument("--out", default=str(RESULTS / "serving_llamacpp.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, day = load(RESULTS / "serving_llamacpp.jsonl", args.date)
    single: dict[str, list[float]] = defaultdict(list)
    multi: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["mode"] == "single":
            single[r["engine"]].append(r["itl_ms"]["p50"])
        else:
            multi[r["engine"]].append(r["output_tok_per_s"])
    cpu = rows[0]["machine"].get("cpu", "") if rows else ""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, data, title, unit in (
        (axes[0], single, "one stream: ITL p50 (lower is better)", "ms"),
        (axes[1], multi, "64 streams: output tok/s (higher is better)", "tok/s"),
    ):
        names = sorted(data, key=lambda n: (n != "llama.cpp", n))
        meds = [statistics.median(data[n]) for n in names]
        colors = ["tab:orange" if n == "llama.cpp" else "tab:blue" for n in names]
        ax.bar(names, meds, color=colors)
        for i, n in enumerate(names):
            ax.scatter([i] * len(data[n]), data[n], color="black", s=12, zorder=3)
            ax.annotate(f"{meds[i]:.1f}", (i, meds[i]), ha="center", va="bottom", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(unit)
    fig.suptitle(f"SmolLM2-135M Q4_1 GGUF, 2 threads, {cpu}, {day} (dots: invocations)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(args.out)


if __name__ == "__main__":
    main()
