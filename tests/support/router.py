"""Replicas of `appliance serve` behind vllm-router, as processes on loopback (no tests here).

The router is the one docs/scaling.md recommends, started with the same flags
(`ROUTER_FLAGS`); the replicas are `appliance serve` processes started through
`tests.support.fault_launcher`'s `gate` fault, so a test can hold a replica's engine steps
(its requests stay in flight, as on a busy machine) and release them, and can SIGKILL a
replica as a crash would. Nothing here waits on the clock: readiness is polled from the
router's own `/readiness`, and the hang guard only turns a hang into a failure.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.served_stack import ServeProcess, spawn_serve, tiny_serve_sets
from tests.support.waiting import HANG_S, wait_for

# What docs/scaling.md runs in front of N replicas: cache-aware routing; a circuit breaker
# that opens before the retries run out, so a request whose replica died is retried on a
# live one instead of being answered 500; health from /ready, which turns 503 while a
# replica drains, so a draining replica leaves the pool.
ROUTER_FLAGS = (
    "--policy", "cache_aware",
    "--cb-failure-threshold", "2",
    "--retry-max-retries", "5",
    "--health-check-endpoint", "/ready",
    "--health-check-interval-secs", "5",
    "--health-failure-threshold", "2",
    "--worker-startup-check-interval", "2",
)  # fmt: skip

OPEN = 10**12  # gate value: every step may run


def router_binary() -> str | None:
    """The `vllm-router` console script next to this interpreter, else on PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


def cannot_run_reason() -> str | None:
    """Why the router cannot run here, or None when `vllm-router --help` works."""
    binary = router_binary()
    if binary is None:
        return "vllm-router is not installed (pip install -e '.[dev]' pins vllm-router==0.1.17)"
    done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=HANG_S)
    if done.returncode != 0:
        return f"vllm-router does not run here: {done.stderr.strip()[-300:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FileGate:
    """How many engine steps a gated replica may run (fault_launcher's `gate` file)."""

    def __init__(self, path: Path, steps: int = OPEN):
        self.path = path
        self.set(steps)

    def set(self, steps: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(str(steps))
        tmp.replace(self.path)  # the server never reads a half-written number

    def hold(self) -> None:
        self.set(0)  # the step count is never below 0: every later step is held

    def release(self) -> None:
        self.set(OPEN)


@dataclass
class Replica:
    serve: ServeProcess
    gate: FileGate

    @property
    def url(self) -> str:
        return self.serve.url


def start_replica(model_dir: Path, gate_path: Path, **sets: Any) -> Replica:
    """`appliance serve` on a free port (HTTP only), its steps behind an open gate."""
    gate = FileGate(gate_path)
    args = ["gate", str(gate_path), "--", "serve", *tiny_serve_sets(model_dir, grpc=False, **sets)]
    return Replica(spawn_serve(args, module="tests.support.fault_launcher"), gate)


@dataclass
class RouterProcess:
    proc: subprocess.Popen
    url: str
    log: Path

    def readiness(self) -> dict:
        return httpx.get(f"{self.url}/readiness", timeout=HANG_S).json()

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(HANG_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(HANG_S)


def start_router(worker_urls: list[str], log: Path) -> RouterProcess:
    """vllm-router on a free loopback port in front of `worker_urls`; returns once its
    /readiness counts every worker healthy (or fails with the router's log)."""
    binary = router_binary()
    assert binary is not None, cannot_run_reason()
    port = _free_port()
    args = [
        binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
        *ROUTER_FLAGS, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    router = RouterProcess(proc, f"http://127.0.0.1:{port}", log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"vllm-router exited {proc.returncode}:\n{router.log_tail()}")
        try:
            return router.readiness().get("healthy_workers") == len(worker_urls)
        except (httpx.HTTPError, ValueError):
            return False  # not listening yet

    try:
        wait_for(ready, "vllm-router ready with every worker healthy")
    except BaseException:
        router.stop()
        raise
    return router
