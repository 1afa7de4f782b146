"""Is a process still running, for tests that check no worker outlives its engine (no tests)."""

from __future__ import annotations

from pathlib import Path


def is_running(pid: int) -> bool:
    """False once `pid` has exited, including as a zombie nobody has reaped yet (its parent
    died, and the container's init reaps when it gets to it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
