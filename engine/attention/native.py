"""Builds and loads the CPU paged-attention kernel (csrc/paged_attention.c) with ctypes.

Why C and ctypes rather than a torch C++ extension: the kernel needs no torch headers, so
one `cc` call builds it in about a second on first use (a torch extension takes minutes on
two cores), and it is cached under `~/.cache/appliance/kernels/` keyed by the source, the
flags, the compiler and this CPU's feature flags (it is built with `-march=native`). It is
linked with `-fopenmp` and loaded after torch, whose bundled `libgomp.so.1` then satisfies
the dependency, so both share one OpenMP runtime and thread pool.

Nothing here is required: without a C compiler, or with `APPLIANCE_CPU_KERNELS=off`, the
torch backend keeps its index_select + SDPA path and says why once in the log.
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

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
# Limits of the kernel's stack buffers (csrc/paged_attention.c); larger shapes use torch.
MAX_GROUP, MAX_BLOCK, MAX_HEAD_DIM = 64, 256, 512

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def _cache_dir() -> Path:
    root = os.environ.get("APPLIANCE_KERNEL_CACHE") or Path.home() / ".cache/appliance/kernels"
    return Path(root)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cc: str) -> Path:
    src = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        src + " ".join(FLAGS).encode() + version.encode() + _cpu_flags().encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"paged_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        proc = subprocess.run(
            [cc, *FLAGS, "-o", str(tmp_so), str(SOURCE), "-lm"], capture_output=True, text=True
        )
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
    fn = lib.paged_attention
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i32, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32, i32,
                   ctypes.c_float, ptr, i64, i32]  # fmt: skip
    fn.restype = ctypes.c_int
    return lib


def kernel() -> ctypes.CDLL | None:
    """The loaded library, or None (built on first call; failures are logged once)."""
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _load()
            except Exception as e:  # noqa: BLE001 - any failure means: use the torch path
                _error = str(e)
                logger.info("CPU paged-attention kernel unavailable (%s); using index_select + SDPA", e)
    return _lib


def supports(q: torch.Tensor, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
    """Whether paged_attention can serve this layer's tensors."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and kv_cache.dtype in (torch.float32, torch.bfloat16)
        and kv_cache.is_contiguous()
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and kv_cache.shape[2] <= MAX_BLOCK
        and kv_cache.shape[4] <= MAX_HEAD_DIM
        and kernel() is not None
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D] fp32, rows contiguous
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D] fp32/bf16, contiguous
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    q_rows: torch.Tensor,  # [N] int64: rows of q (and out) to compute
    reqs: torch.Tensor,  # [N] int64: each row's request (row of block_tables)
    pos: torch.Tensor,  # [N] int64: each row's position; it sees keys <= pos
    out: torch.Tensor,  # [T, H, D] fp32, written at q_rows only
    scale: float,
    window: int | None,
) -> None:
    lib = kernel()
    assert lib is not None, "call supports() first"
    H, D = q.shape[1], q.shape[2]
    Hkv, block_size = kv_cache.shape[3], kv_cache.shape[2]
    for t in (q, out):
        assert t.stride(2) == 1 and t.stride(1) == D, "q/out rows must be [H, D] contiguous"
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    rc = lib.paged_attention(
        q.data_ptr(), q.stride(0), kv_cache.data_ptr(), int(kv_cache.dtype == torch.bfloat16),
        tables.data_ptr(), tables.stride(0), q_rows.data_ptr(), reqs.data_ptr(), pos.data_ptr(),
        q_rows.numel(), H, Hkv, D, block_size, int(window or 0), float(scale), out.data_ptr(),
        out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError("paged_attention: shape past the kernel's limits")
