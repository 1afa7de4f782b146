"""What a compiled grammar costs in memory, measured where it lives: the C heap.

A grammar's memory is llguidance's, not Python's: its lexer states (built by the first
mask, a regex like `a{170000}` alone makes ~55 MB of them), shared by the cached template
and every request's copy, so the cache entry keeps them alive. Python cannot see their
size, but glibc's `mallinfo2` reports the bytes its heap has handed out (every arena, mmap'd
chunks too): the difference across a grammar's build and probe is its size. Builds running
side by side are each charged the other's bytes, and other threads' allocations land in the
window too, so the figure errs high under load (a cache bounded by it stays within bound);
frees meanwhile can make it low, so it never goes below a floor from the grammar's text.

Freed memory is not returned to the system by glibc on its own (measured: dropping five
such grammars left RSS 150 MB above the baseline until `malloc_trim`), so the cache trims
after it drops megabytes. Without glibc (musl, macOS) nothing can be measured: sizes are
the floor estimate and trimming does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# The floor of an estimate: the grammar's text several times over, and a fixed overhead.
_TEXT_FACTOR = 16
_BASE_BYTES = 64 * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


class HeapMeter:
    """Reads the C heap's bytes in use and gives freed ones back (glibc); no-ops elsewhere."""

    def __init__(self) -> None:
        self._libc = None
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name or "libc.so.6")
            libc.mallinfo2.restype = _MallInfo2
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
            self._libc = libc
        except (OSError, AttributeError):  # not glibc (or older than 2.33)
            pass

    @property
    def available(self) -> bool:
        return self._libc is not None

    def in_use(self) -> int | None:
        """Bytes handed out by malloc and not freed (None when it cannot be read)."""
        if self._libc is None:
            return None
        info = self._libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def trim(self) -> None:
        """Returns the heap's free pages to the system."""
        if self._libc is not None:
            self._libc.malloc_trim(0)


def floor_bytes(grammar_text: str) -> int:
    """The least a grammar is charged: what its text implies, whatever was measured."""
    return _BASE_BYTES + _TEXT_FACTOR * len(grammar_text)
