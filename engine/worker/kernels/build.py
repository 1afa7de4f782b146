"""Builds and loads the CPU kernels (csrc/*.c) as one shared library through ctypes.

Why C and ctypes rather than a torch C++ extension: the kernels need no torch headers, so
one `cc` call builds them in a couple of seconds on first use (a torch extension takes
minutes on two cores). The library is cached under `cache_dir()` keyed by the sources,
the flags, the compiler and this CPU's feature flags, since it is built with
`-march=native`. It is linked with `-fopenmp` and
loaded after torch, whose bundled `libgomp.so.1` then satisfies the dependency, so both
share one OpenMP runtime and thread pool.

Failures (no compiler, a compile error, `APPLIANCE_CPU_KERNELS=off`) are logged once and
`library()` returns None: callers keep their torch path. `APPLIANCE_KERNEL_MARCH` replaces
`native` in `-march=` (tests build the AVX2 and the plain C paths on an AVX-512 box with
`x86-64-v3` and `x86-64`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch  # noqa: F401 - loads torch's libgomp before ours is resolved

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    "paged_attention.c", "fused_ops.c", "cache_write.c", "quant_linear.c", "quant_linear_i8.c",
    "quant_linear_q4g.c", "decoder_stack.c", "prefill_attention.c", "amx_linear.c",
)  # fmt: skip
FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fno-trapping-math",
]

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {  # name -> argtypes; every function returns int or nothing
    "paged_attention": [_ptr, _i64, _i32, _ptr, _i32, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i32,
                        _i32, _i32, _i32, _i32, _f32, _ptr, _i64, _i32],
    "fused_add_rms_norm": [_ptr, _i64, _ptr, _i64, _ptr, _f32, _ptr, _i64, _i64, _i32, _i32,
                           _i32],
    "silu_and_mul": [_ptr, _i64, _ptr, _i64, _i64, _i32, _i32, _i32],
    "rope_inplace": [_ptr, _i64, _i32, _i32, _ptr, _ptr, _ptr, _i64, _i32, _i32],
    "write_kv": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i32, _i32, _i32],
    "quant_linear": [_ptr, _i64, _ptr, _i32, _i64, _i64, _ptr, _ptr, _i64, _i64, _i32],
    "quant_linear_i8": [_ptr, _i64, _ptr, _i32, _i64, _i64, _ptr, _ptr, _i64, _i64, _i32],
    "quant_linear_rounded": [_ptr, _i64, _ptr, _i32, _i64, _i64, _ptr, _ptr, _i64, _i64, _i32],
    "quant_linear_bf16": [_ptr, _i64, _ptr, _i32, _i64, _i64, _ptr, _ptr, _i64, _i64, _i32],
    "q4g_bf16_native": [],
    "q4g_use_bf16_dot": [_i32],
    "q4g_i16_prep": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr],
    "decoder_stack": [_ptr, _ptr, _i32],
    "q4g_dequantize_t": [_ptr, _i64, _i64, _ptr, _i32, _i32],
    "decoder_stack_workspace": [_ptr, _i64],
    "quant_dequantize": [_ptr, _i32, _i64, _i64, _ptr, _i32],
    "quant_dequantize_bf16": [_ptr, _i32, _i64, _i64, _ptr, _i32],
    "argmax_rows_bf16": [_ptr, _i64, _i64, _i64, _ptr, _i32],
    "prefill_attention": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64,
                          _i32, _i32, _i32, _f32, _i32, _i32],
    "amx_bf16_ready": [],
    "amx_bf16_pack": [_ptr, _i64, _i64, _ptr],
    "amx_bf16_linear": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i32],
    "screen_rows_bf16": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _f32, _i64, _ptr,
                         _ptr, _i32],
}  # fmt: skip

_RETURNS_INT = (
    "paged_attention", "quant_linear", "quant_linear_i8", "quant_linear_rounded",
    "quant_linear_bf16", "q4g_bf16_native", "decoder_stack", "prefill_attention", "q4g_i16_prep",
    "amx_bf16_ready",
)  # fmt: skip

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def cache_dir() -> Path:
    """APPLIANCE_KERNEL_CACHE, else $XDG_CACHE_HOME/appliance/kernels (~/.cache by default)."""
    if os.environ.get("APPLIANCE_KERNEL_CACHE"):
        return Path(os.environ["APPLIANCE_KERNEL_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "appliance" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _flags() -> list[str]:
    march = os.environ.get("APPLIANCE_KERNEL_MARCH")
    return [f"-march={march}" if march and f == "-march=native" else f for f in FLAGS]


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    flags = _flags()
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):  # sources and headers
        h.update(path.name.encode() + path.read_bytes())
    h.update(" ".join(flags).encode() + version.encode() + _cpu_flags().encode())
    out = cache_dir() / f"appliance_kernels-{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        cmd = [cc, *flags, "-o", str(tmp_so), *(str(CSRC / s) for s in SOURCES), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp_so, out)  # atomic: concurrent builders never see half a file
    return out


def _load() -> ctypes.CDLL:
    if os.environ.get("APPLIANCE_CPU_KERNELS", "auto").lower() in ("0", "off", "false", "no"):
        raise RuntimeError("disabled by APPLIANCE_CPU_KERNELS")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    lib = ctypes.CDLL(str(_build(cc)))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int if name in _RETURNS_INT else None
    lib.decoder_stack_workspace.restype = ctypes.c_int64
    lib.q4g_use_bf16_dot(_bf16_mode())
    how = _BF16_HOW.get(lib.q4g_bf16_native(), "?")
    logger.info("CPU kernels loaded; the q4 kernels take bf16 rows %s", how)
    return lib


# How the q4 column-group kernels multiply bf16 rows (csrc/quant_q4g.h's Q4G_BF16_*).
BF16_MODES = {"off": 0, "on": 1, "i16": 2}
_BF16_HOW = {  # q4g_bf16_native() -> words for the load's log line
    0: "widened to fp32",
    1: "through VDPBF16PS",
    2: "as exact int16 planes (VPDPWSSD)",
}


def _bf16_mode() -> int:
    """How the q4 kernels multiply bf16 rows here (csrc/quant_linear_q4g.c): on AMD (Zen 4/5)
    VDPBF16PS ("on"); on Intel, where VDPBF16PS issues at half the FMA rate, the rows as exact
    int16 planes and VPDPWSSD ("i16"; a build without AVX512-VNNI widens them to fp32 instead).
    `APPLIANCE_Q4G_BF16_DOT=on|off|i16` decides instead ("off": widened to fp32)."""
    forced = os.environ.get("APPLIANCE_Q4G_BF16_DOT", "auto").lower()
    if forced in BF16_MODES:
        return BF16_MODES[forced]
    from engine.worker.cpu_features import detect_cpu_features

    return BF16_MODES["i16" if detect_cpu_features().vendor == "GenuineIntel" else "on"]


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (built on first call; a failure is logged once)."""
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _load()
            except Exception as e:  # noqa: BLE001 - any failure means: use the torch path
                _error = str(e)
                logger.info("CPU kernels unavailable (%s); using the plain torch ops", e)
    return _lib
