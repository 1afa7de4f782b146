"""Keep freed host memory for reuse, so a CPU step's large activations stop costing page faults.

Every CPU step allocates and frees the same few large tensors (a 2,048-token prefill chunk's
MLP activations are several MiB each). glibc's malloc serves blocks above its mmap threshold
with fresh `mmap`s and returns free memory at the top of its heap to the OS once it exceeds
the trim threshold (both start at 128 KiB and move with what is freed, the mmap threshold
up to 32 MiB), so the next step's tensors arrive as new pages: a page fault and a zeroed
4 KiB page each time. On a 2-core Xeon (`python bench/malloc_keep.py`, llama50m in bf16,
bench/results/malloc_keep.jsonl): W64's prompts alone (one output token each) took
26,000-204,000 minor faults and 0.05-0.37 s of system time a run with glibc's defaults,
500-11,000 and 0-0.04 s with the settings below, and ran 1.13x faster (the median of 18
runs paired by prompts; 17 faster); the whole W64 (128 decode steps) 0.99x, no change
beyond this box's noise, with faults 2,000-173,000 -> 1,700-16,500. vLLM's CPU guide gets
the same effect by preloading tcmalloc.

`keep_freed_memory(keep_mib)` fixes the mmap threshold at glibc's largest (32 MiB) and the
trim threshold at `keep_mib`: blocks up to 32 MiB come from the heap and freed memory stays
there up to `keep_mib` MiB. The engine calls it once its weights and KV cache are
allocated (`runtime.malloc_keep_mib`), so loading's temporaries were already given back and
the memory measured after loading is what it was. RSS grows to the steps' high-water mark
and stays there, by at most `keep_mib` beyond what is in use. Only glibc is tuned; another C
library (musl) is left as it is, with a log line.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD_MAX = 32 << 20


def glibc_version() -> str | None:
    """The glibc version ("2.36"), or None elsewhere (musl, macOS)."""
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
    except (AttributeError, ValueError, OSError):
        return None
    if not name or not name.startswith("glibc "):
        return None
    return name.split(" ", 1)[1]


def keep_freed_memory(keep_mib: int) -> bool:
    """Tunes glibc's malloc as the module docstring says; returns whether it did (False with
    `keep_mib` 0, or on another C library). Process-wide, so call it once, after loading."""
    if keep_mib <= 0:
        return False
    version = glibc_version()
    if version is None:
        logger.info("runtime.malloc_keep_mib: not glibc, malloc left as it is")
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trim = min(keep_mib << 20, 2**31 - 1)  # mallopt takes an int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, trim) == 1
    if ok:
        logger.info(
            "host malloc (glibc %s): blocks up to %d MiB from the heap, up to %d MiB of freed "
            "memory kept for reuse (runtime.malloc_keep_mib)",
            version, MMAP_THRESHOLD_MAX >> 20, trim >> 20,
        )  # fmt: skip
    else:
        logger.warning("runtime.malloc_keep_mib: glibc %s refused mallopt; left as it is", version)
    return ok
