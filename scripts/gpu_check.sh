#!/usr/bin/env bash
# The GPU check for issue 6, on the lent H200 (see docs/gpu.md for the whole procedure).
#
#   here, on the CPU box:   scripts/gpu_check.sh prepare
#       downloads the two wheels FlashInfer needs there and splits them into .whl/a and
#       .whl/b (ignored by git), each small enough to travel with the repo (64 MiB a call)
#   device call 1:  run(command="bash scripts/gpu_check.sh stage", carry=[".whl/a"], timeout_s=120)
#       keeps part a in /tmp and starts writing the random Llama-3-8B checkpoint (setsid)
#   device call 2, within 30 s:  run(command="bash scripts/gpu_check.sh all",
#                                    carry=[".whl/b"], timeout_s=600)
#       joins and installs the wheels, builds FlashInfer's kernels, runs tests/worker/test_gpu.py,
#       then bench/gpu_decode.py until its deadline; JSON and logs under $OUT
#   optional call 3, within 30 s:  run(command="bash scripts/gpu_check.sh bench", timeout_s=420)
#       resumes the benchmark where call 2's deadline stopped it
#
# What travels: flashinfer-python 0.7.2.post1 (py3-none-any, 62 MB) and apache-tvm-ffi
# 0.1.15.post2 (cp312 manylinux_2_28, 3.3 MB). Everything else FlashInfer imports (torch,
# numpy, einops, nvidia-ml-py, tabulate, click, requests, tqdm, ninja) is in the machine's
# image; its optional extras (cutlass-dsl, cudnn-frontend, cuda-tile, nccl4py) are not needed
# for the paged decode/prefill kernels, which FlashInfer JIT-compiles with the image's nvcc.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
WHEELS=("flashinfer-python==0.7.2.post1" "apache-tvm-ffi==0.1.15.post2")
STATE=/tmp/gpu_state          # survives between calls while the machine stays warm
SITE=/tmp/gpu_site            # pip --target for the carried wheels
CKPT=/tmp/llama3-8b-random
OUT=${OUT:-/tmp/gpu_out}
PY=${PY:-python3}
BUDGET=${GPU_CHECK_BUDGET:-570}  # seconds this call may use (the tool's limit is 600)
mkdir -p "$OUT" "$STATE"

log() { echo "[gpu_check +${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }

prepare() {  # on the CPU box: fetch the exact wheels and split them for two calls
    local py=.venv/bin/python
    [ -x "$py" ] || py=python3
    rm -rf .whl && mkdir -p .whl/full .whl/a .whl/b || exit 1
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl/full "${WHEELS[@]}" || exit 1
    (cd .whl/full && sha256sum ./*.whl >../SHA256SUMS)
    local fi_whl
    fi_whl=$(ls .whl/full/flashinfer_python-*.whl)
    split -b 32M -d -a 2 "$fi_whl" ".whl/a/$(basename "$fi_whl").part"
    ls .whl/a/*.part0[2-9] >/dev/null 2>&1 && { echo "wheel needs a third part: raise -b"; exit 1; }
    mv .whl/a/*.part01 .whl/b/
    cp .whl/full/apache_tvm_ffi-*.whl .whl/b/
    cp .whl/SHA256SUMS .whl/a/ && cp .whl/SHA256SUMS .whl/b/
    rm -rf .whl/full
    du -sh .whl/a .whl/b
    echo "repo files that travel: $(git ls-files -co --exclude-standard -z | du -ch --files0-from=- | tail -1)"
}

stage() {  # device call 1: keep part a, start the checkpoint so call 2 finds it written
    cp .whl/a/* .whl/b/* "$STATE/" 2>/dev/null
    ls -la "$STATE"
    if [ ! -f "$CKPT/config.json" ] && ! ckpt_running; then
        setsid nohup "$PY" bench/gpu_decode.py --only "" --model-dir "$CKPT" \
            --out "$STATE/ckpt.json" >"$STATE/ckpt.log" 2>&1 </dev/null &
        echo $! >"$STATE/ckpt.pid"
        echo "checkpoint generation started (pid $!)"
    fi
}

ckpt_running() { [ -f "$STATE/ckpt.pid" ] && kill -0 "$(cat "$STATE/ckpt.pid")" 2>/dev/null; }

install_wheels() {
    cp .whl/a/* .whl/b/* "$STATE/" 2>/dev/null
    if [ -f "$SITE/.installed" ]; then log "wheels already installed in $SITE"; return 0; fi
    if (
        cd "$STATE" || exit 1
        shopt -s nullglob
        parts=(flashinfer_python-*.whl.part*)
        [ ${#parts[@]} -ge 2 ] || { echo "missing wheel parts: have ${parts[*]:-none}"; exit 1; }
        cat "${parts[@]}" >"${parts[0]%.part00}" && sha256sum -c SHA256SUMS || exit 1
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" ./*.whl
    ) >>"$OUT/summary.txt" 2>&1; then
        touch "$SITE/.installed"
        log "installed carried wheels"
    else
        log "FLASHINFER NOT INSTALLED (see above): the torch backend is what gets measured"
    fi
}

setup_env() {
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}  # Hopper only: shorter builds
    export FLASHINFER_WORKSPACE_BASE=$STATE  # JIT cache kept for later calls on this machine
    export MAX_JOBS=${MAX_JOBS:-16} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    if [ -z "${CUDA_HOME:-}" ]; then
        if command -v nvcc >/dev/null; then CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
        else CUDA_HOME=/usr/local/cuda; fi
        export CUDA_HOME
    fi
}

env_report() {
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
        "$CUDA_HOME/bin/nvcc" --version | tail -2
        "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
        "$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
        nproc; free -g | head -2; df -h /tmp | tail -1
    } >"$OUT/env.txt" 2>&1
    log "env: $(tr '\n' ' ' <"$OUT/env.txt" | cut -c1-400)"
}

JIT_PIDS=()
warm_jit() {  # FlashInfer JIT-compiles each kernel family on first use: build them in parallel
    for kind in decode prefill decode-window prefill-window; do
        MAX_JOBS=4 timeout 330 "$PY" bench/gpu_decode.py --warm-jit "$kind" >>"$OUT/jit.log" 2>&1 &
        JIT_PIDS+=($!)
    done
}

ensure_checkpoint() {  # start (or join) the checkpoint writer; returns immediately
    if [ ! -f "$CKPT/config.json" ] && ! ckpt_running; then
        "$PY" bench/gpu_decode.py --only "" --model-dir "$CKPT" --out "$STATE/ckpt.json" \
            >"$STATE/ckpt.log" 2>&1 &
        echo $! >"$STATE/ckpt.pid"
    fi
}

wait_checkpoint() {
    while ckpt_running && [ "$SECONDS" -lt "$BUDGET" ]; do sleep 2; done
    if [ -f "$CKPT/config.json" ]; then
        log "checkpoint ready"
    else
        log "checkpoint missing: $(tail -3 "$STATE/ckpt.log" 2>/dev/null)"
    fi
}

run_tests() {
    local limit=$((BUDGET - SECONDS - 240))
    [ "$limit" -gt 60 ] || limit=60
    log "tests/worker/test_gpu.py (limit ${limit}s)"
    timeout "$limit" "$PY" -m pytest tests/worker/test_gpu.py -rs -p no:cacheprovider -m "not slow" \
        >"$OUT/tests.log" 2>&1
    log "tests exit $?: $(grep -E "passed|failed|skipped|error" "$OUT/tests.log" | tail -1)"
}

run_bench() {
    local left=$((BUDGET - SECONDS - 100))
    [ "$left" -gt 30 ] || { log "no time left for the benchmark (rerun: gpu_check.sh bench)"; return; }
    log "bench/gpu_decode.py (deadline ${left}s)"
    timeout $((left + 90)) "$PY" bench/gpu_decode.py --model-dir "$CKPT" --deadline "$left" \
        --out "$STATE/gpu_decode.json" >>"$OUT/bench.log" 2>&1
    log "bench exit $?"
    cp "$STATE/gpu_decode.json" "$OUT/" 2>/dev/null
}

all() {
    setup_env
    install_wheels
    env_report
    ensure_checkpoint
    warm_jit
    for pid in "${JIT_PIDS[@]}"; do wait "$pid"; done
    log "jit warm-up done: $(grep -c 'ready in' "$OUT/jit.log")/4 kernel families built"
    run_tests
    wait_checkpoint
    run_bench
}

case "${1:-all}" in
    prepare) prepare ;;
    stage) stage ;;
    all) all ;;
    tests) setup_env; install_wheels; env_report; run_tests ;;
    bench) setup_env; install_wheels; wait_checkpoint; run_bench ;;
    *) echo "usage: $0 prepare|stage|all|tests|bench"; exit 2 ;;
esac
log "done in ${SECONDS}s"
