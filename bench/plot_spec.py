"""spec_copy.png from the latest full run in bench/results/spec_copy.jsonl (bench/spec_copy.py:
the copy task, one greedy stream, ours with and without speculation).

Left: median TPOT per method, each repeat as a dot (the box is shared: the dots show the
spread), the speed-up over no speculation and the mean acceptance length on each bar.
Right: per-position acceptance (the share of drafts whose i-th proposal was accepted) per
method, the curve the adaptive rule's k follows.

    python bench/plot_spec.py            # writes bench/results/spec_copy.png
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, read_jsonl  # noqa: E402

SOURCE = RESULTS_DIR / "spec_copy.jsonl"


def latest() -> dict[str, Any] | None:
    rows = [r for r in read_jsonl(SOURCE) if r.get("model", {}).get("name") != "tiny"]
    return rows[-1] if rows else None


def plot(record: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(record["settings"]["speculative_configs"])
    methods += [v for v in record["settings"].get("vllm_speculative_configs", {}) if v in record]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, m in enumerate(methods):
        r = record[m]
        vllm = m.startswith("vllm-")
        none = "vllm-none" if vllm else "none"
        pts = [x for x in r["tpot_ms_all"] if x is not None]
        color = "#bbbbbb" if m == none else ("#ff7f0e" if vllm else "#1f77b4")
        left.bar(i, r["tpot_ms"], color=color)
        left.scatter([i] * len(pts), pts, color="black", s=10, zorder=3)
        base = record.get(none, {}).get("tpot_ms")
        label = (
            ""
            if m == none or not base
            else f"{round(base / r['tpot_ms'], 2)}x\nacc.len {r.get('mean_acceptance_length')}"
        )
        left.text(i, r["tpot_ms"], label, ha="center", va="bottom", fontsize=8)
        if r.get("accepted_per_pos"):
            pos = range(1, len(r["accepted_per_pos"]) + 1)
            right.plot(pos, r["accepted_per_pos"], marker="o", label=m)
    left.set_ylim(
        0, 1.3 * max(x for m in methods for x in record[m]["tpot_ms_all"] if x is not None)
    )
    left.set_xticks(range(len(methods)), methods)
    left.set_ylabel("TPOT, ms (median; dots: repeats; orange: vLLM)")
    left.set_title(f"copy task, one greedy stream, {record['model']['name']}")
    right.set_xlabel("proposal position")
    right.set_ylabel("share of drafts accepted there")
    right.set_ylim(0, 1.05)
    right.legend()
    right.set_title("acceptance per position")
    m = record["machine"]
    fig.suptitle(f"{m.get('cpu')}, {m.get('cores')} cores, {record['date'][:10]} "
                 f"(other cores busy: {record['none']['other_cores_all']})", fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main() -> int:
    record = latest()
    if record is None:
        print(f"no full run in {SOURCE}")
        return 1
    print(plot(record, RESULTS_DIR / "spec_copy.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
