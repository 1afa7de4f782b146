#!/usr/bin/env bash
# The GPU check of issue 14, in ONE device command (docs/gpu.md has the procedure).
#
#   here:    scripts/gpu_check.sh prepare
#       downloads flashinfer-python 0.7.2.post1 and apache-tvm-ffi 0.1.15.post2 and leaves in
#       .gpu/ (git-ignored) FlashInfer trimmed to its Python package and the sources/headers
#       its FA2 decode/prefill JIT needs (tar.xz, ~9 MB), the tvm-ffi wheel (3.3 MB), SHA256SUMS
#   device:  run(command="bash scripts/gpu_check.sh", carry=[".gpu"], timeout_s=550)
#   CPU:     scripts/gpu_check.sh --dry-run     (every phase, tiny shapes, torch backend;
#            bounded by its 560 s budget only, not by the device's per-phase limits)
#
# Options: --only a,b,...  run only these phases (a rerun repeats what failed)
#          --dry-run       CPU, tiny shapes, torch backend; no .gpu needed
# Phases, in order, each under its own `timeout` and never past GPU_CHECK_BUDGET seconds:
#   setup    install .gpu into /tmp/gpu_site, record versions
#   jit      build the FlashInfer modules the backend needs (MAX_JOBS=16, seconds per module)
#   backend  tests/worker/test_gpu.py: FlashInfer vs the torch backend (no-window kernels)
#   graphs   tests/worker/test_gpu.py: graph replay vs eager
#   fidelity tests/worker/test_gpu.py: LLM greedy vs transformers bf16, engine picks FlashInfer,
#            LLM.embed bf16 on FlashInfer vs sentence-transformers
#   served   appliance serve on the device: health, streamed chat, gRPC stream
#   kv       KV sizing at 0.9 with 256 sequences, an OOM-free top-p step (Llama-3-8B shape)
#   decode   decode tok/s at batch 1/8/64/256, context 512, eager vs graphs (Llama-3-8B shape)
#   fp8      Llama-3-8B shape: fp8 KV pages vs bf16 pages (JIT of the e4m3-page modules,
#            teacher-forced log-probs, decode tok/s at batch 1/64), then fp8 linears vs bf16
#   spec     speculative decoding (n-gram, draft model): verify steps on FlashInfer's prefill
#            plan, eager beside the decode graphs; greedy equal to no speculation (bench/gpu_spec.py)
#   kvtier   tests/worker/test_gpu.py: KV tier copy stream + pinned buffers, greedy unchanged
#            with host + disk tiers (issue 30)
#   fp8kv    tests/worker/test_gpu.py: fp8 KV pages vs the torch backend on their values,
#            under decode graphs, served by the engine (twice the blocks), across the tier's
#            copy stream (issue 26; last, so it displaces no older phase)
# Output: $OUT/gpu_check.log (everything, as it happens) and $OUT/gpu_check.json (per phase:
# status, exit code, seconds, results). Exit status 1 if any phase failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
WHEELS=("flashinfer-python==0.7.2.post1" "apache-tvm-ffi==0.1.15.post2")
# What the engine and the served phase import that the device image lacks (llguidance and
# xxhash are imported by `from engine import LLM`; the server needs starlette, uvicorn,
# pydantic; the committed gRPC stubs need grpcio >= 1.85.1 and protobuf >= 7.35.1), at the
# versions the CPU venv runs. Installed with --no-deps into $SITE, ahead of the image's own.
DEPS=("llguidance==1.9.1" "xxhash==4.1.0" "starlette==1.10.0" "uvicorn==0.55.0"
      "pydantic==2.14.4" "pydantic_core==2.50.5" "annotated-types==0.8.0"
      "typing-inspection==0.4.5" "typing_extensions==4.16.0" "grpcio==1.85.4"
      "grpcio-health-checking==1.85.1" "grpcio-reflection==1.85.1" "protobuf==7.36.2"
      "googleapis-common-protos==1.76.0" "gguf==0.19.0")
CARRY=.gpu
SITE=/tmp/gpu_site
PY=${PY:-python3}
ALL_PHASES=(setup jit backend graphs fidelity served kv decode fp8 spec kvtier fp8kv)
declare -A LIMIT=([setup]=60 [jit]=200 [backend]=90 [graphs]=90 [fidelity]=120 [served]=120
                  [kv]=120 [decode]=120 [fp8]=300 [spec]=120 [kvtier]=90 [fp8kv]=150)
# pytest phases: a -k selection of tests/worker/test_gpu.py (the dry run checks it selects some)
declare -A TESTS=([backend]="(flashinfer_matches and not 24) or start_up_probe" [graphs]="graph_replays"
                  [fidelity]="transformers or picks_flashinfer or embeddings_on_cuda" [kvtier]="kv_tier"
                  [fp8kv]="fp8_pages")

prepare() {  # on the CPU box: the trimmed FlashInfer and the tvm-ffi wheel, in .gpu/
    local py=.venv/bin/python dl tree
    [ -x "$py" ] || py=python3
    dl=$(mktemp -d) && tree=$(mktemp -d) || exit 1
    trap 'rm -rf "$dl" "$tree"' RETURN
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dl" \
        "${WHEELS[@]}" || return 1
    rm -rf "$CARRY" && mkdir -p "$CARRY/deps" || return 1
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$CARRY/deps" \
        "${DEPS[@]}" || return 1
    (cd "$tree" && unzip -q "$dl"/flashinfer_python-*.whl) || return 1
    # Keep the Python package, include/ and cccl/ (FA2 decode/prefill need flashinfer's own
    # headers, CCCL's and tvm-ffi's); of csrc/ only the batch decode/prefill sources, not sm90/MLA/fp8.
    # fp8 KV pages need none of the *fp8* files: those are FA3's fp8-query kernels
    # (batch_prefill_fp8_*sm90*); FA2 decode/prefill over e4m3 pages are the same sources
    # (batch_decode.cu, batch_prefill*.cu, the kernel_inst jinja) instantiated with an
    # e4m3 KV type, and FLASHINFER_ENABLE_FP8_E4M3 is among FlashInfer's default nvcc flags.
    local data=$tree/flashinfer/data
    rm -rf "$data/cutlass"  # FA2 uses none of it; CCCL stays (fastdiv.cuh needs libcudacxx's
    # cuda::fast_mod_div, which CUDA 13.0's own headers lack: the first device run failed there)
    find "$data/csrc" -mindepth 1 -maxdepth 1 \
        ! \( -name 'batch_decode*' -o -name 'batch_prefill*' -o -name '*.h' \) -exec rm -rf {} +
    find "$data/csrc" \( -name '*sm90*' -o -name '*mla*' -o -name '*fp8*' \) -delete
    find "$tree" -name __pycache__ -prune -exec rm -rf {} +
    tar -C "$tree" -cf - flashinfer flashinfer_python-0.7.2.post1.dist-info |
        xz -T0 -6 >"$CARRY/flashinfer-0.7.2.post1-fa2.tar.xz" || return 1
    cp "$dl"/apache_tvm_ffi-*.whl "$CARRY/" || return 1
    (cd "$CARRY" && sha256sum ./*.tar.xz ./*.whl ./deps/*.whl >SHA256SUMS)
    git check-ignore -q "$CARRY/SHA256SUMS" || { echo "$CARRY is not git-ignored"; return 1; }
    du -sh "$CARRY"/*
    local repo carried
    repo=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
    carried=$(du -cb "$CARRY" | tail -1 | cut -f1)
    echo "travels: repo $((repo >> 20)) MiB + $CARRY $((carried >> 20)) MiB (limit 64 MiB)"
    [ $((repo + carried)) -le $((64 << 20)) ] || { echo "over 64 MiB"; return 1; }
}

install_carried() {  # device: the trimmed FlashInfer and tvm-ffi into $SITE
    [ -f "$SITE/.installed" ] && return 0
    (cd "$CARRY" && sha256sum -c --quiet SHA256SUMS) || return 1
    mkdir -p "$SITE" && tar -C "$SITE" -xJf "$CARRY"/flashinfer-*.tar.xz || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$CARRY"/apache_tvm_ffi-*.whl "$CARRY"/deps/*.whl || return 1
    touch "$SITE/.installed"
}

phase_cmd() {  # the command of phase $1 (dry run: the CPU variant)
    local p=$1
    if [ -n "${TESTS[$p]:-}" ]; then
        local collect=()
        [ -n "$DRY" ] && collect=(--collect-only)  # CUDA-only tests: check they are selected
        echo "$PY -m pytest tests/worker/test_gpu.py -q -rs -p no:cacheprovider -o addopts= " \
            "${collect[*]} -k '${TESTS[$p]}'"
    elif [ "$p" = decode ]; then
        echo "$PY bench/gpu_decode.py --out $WORK/decode.json ${DRY:+--smoke --device cpu}"
    elif [ "$p" = spec ]; then
        echo "$PY bench/gpu_spec.py --work $WORK $DRY"
    else
        echo "$PY bench/gpu_phases.py $p --work $WORK $DRY"
    fi
}

run_phase() {  # runs phase $1 under its timeout, appends "name rc seconds" to phases.tsv
    local p=$1 left limit t0 rc
    left=$((BUDGET - SECONDS - 5))
    limit=${LIMIT[$p]}
    # The per-phase limits are the device's; a dry run on a CPU box (slow or loaded, as CI
    # may be) is bounded by the budget alone, so its verdict never depends on the box's speed.
    [ -n "$DRY" ] && limit=$left
    [ "$limit" -le "$left" ] || limit=$left
    if [ "$limit" -lt 10 ]; then
        log "phase $p: skipped, ${left}s of the budget left (rerun with --only $p)"
        printf '%s\t124\t0\n' "$p" >>"$WORK/phases.tsv"
        return
    fi
    log "phase $p (timeout ${limit}s): $(phase_cmd "$p")"
    t0=$SECONDS
    if [ "$p" = setup ] && [ -z "$DRY" ] && ! install_carried >>"$LOG" 2>&1; then
        log "setup: could not install $CARRY (run scripts/gpu_check.sh prepare and carry it)"
    fi
    timeout -k 10 "$limit" bash -c "$(phase_cmd "$p")" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\n' "$p" "$rc" "$((SECONDS - t0))" >>"$WORK/phases.tsv"
    log "phase $p: exit $rc in $((SECONDS - t0))s"
    "$PY" bench/gpu_phases.py report --work "$WORK" --out "$OUT" >/dev/null
}

log() { echo "[gpu_check +${SECONDS}s] $*" | tee -a "$LOG"; }

DRY="" ONLY=""
while [ $# -gt 0 ]; do
    case $1 in
        prepare) prepare; exit $? ;;
        --dry-run) DRY=--dry-run ;;
        --only) ONLY=$2; shift ;;
        --only=*) ONLY=${1#--only=} ;;
        *) echo "usage: $0 [prepare] [--dry-run] [--only phase,...]"; exit 2 ;;
    esac
    shift
done
PHASES=("${ALL_PHASES[@]}")
if [ -n "$ONLY" ]; then
    IFS=, read -r -a PHASES <<<"$ONLY"
    for p in "${PHASES[@]}"; do
        [ -n "${LIMIT[$p]:-}" ] || { echo "unknown phase '$p' (${ALL_PHASES[*]})"; exit 2; }
    done
fi
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
WORK=$(mktemp -d /tmp/gpu_check_work.XXXXXX)
LOG=$OUT/gpu_check.log
BUDGET=${GPU_CHECK_BUDGET:-$([ -n "$DRY" ] && echo 560 || echo 520)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MAX_JOBS=${MAX_JOBS:-16}
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/gpu_check_cache}
if [ -z "$DRY" ] && [ -z "${CUDA_HOME:-}" ]; then
    if command -v nvcc >/dev/null; then CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
    else CUDA_HOME=/usr/local/cuda; fi
    export CUDA_HOME PATH=$CUDA_HOME/bin:$PATH
fi
[ -n "$DRY" ] && export CUDA_VISIBLE_DEVICES=""
log "gpu_check ${DRY:-on the device}: phases ${PHASES[*]}; output in $OUT; budget ${BUDGET}s"
for p in "${PHASES[@]}"; do run_phase "$p"; done
"$PY" bench/gpu_phases.py report --work "$WORK" --out "$OUT" >/dev/null
rc=$?
failed=$(awk -F'\t' '$2 != 0 {printf "%s(%s) ", $1, $2}' "$WORK/phases.tsv")
log "done in ${SECONDS}s: ${failed:+failed: $failed}${failed:-all phases passed}; $OUT/gpu_check.json"
rm -rf "$WORK"
exit $rc
