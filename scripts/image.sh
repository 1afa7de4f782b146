#!/usr/bin/env bash
# Build the appliance image with whichever builder this machine has: docker (when its daemon
# answers), else buildah, else podman.
#
#   scripts/image.sh build [cuda|cpu]   build the GPU (default) or CPU image
#   scripts/image.sh builder            print the builder that would be used
#   scripts/image.sh cpu-base           print the CPU base image (made locally if need be)
#
# Environment:
#   IMAGE             tag (default: appliance:latest for cuda, appliance:cpu for cpu)
#   BASE              base image; cuda: the Containerfile's CUDA devel base; cpu:
#                     docker.io/library/debian:bookworm-slim, or, when no registry answers,
#                     localhost/bookworm-local made by scripts/make_base_image.sh
#   IMAGE_BUILDER     docker | buildah | podman, to choose instead of detecting
#   IMAGE_BUILD_ARGS  extra arguments for the builder (word-split), e.g. "--no-cache"
#   TORCH_WHEEL       a torch CPU wheel for the CPU image (default: found in $PIP_FIND_LINKS or
#                     /opt/wheels); without one the build takes torch from PyTorch's CPU index
#   IMAGE_BUILD_CA    1 (default) stages /usr/local/share/ca-certificates/*.crt for pip during
#                     the build (a proxy's CA); they never reach the runtime image. 0: don't.
#   STORAGE_DRIVER    buildah/podman storage driver (default: the existing store's, else vfs)
#   IMAGE_LAYERS      buildah/podman: 1 keeps a cached layer per instruction (warm rebuilds),
#                     0 commits once per stage. Default: 0 on vfs, where each layer is a full
#                     copy of the tree (tens of GB for this image), else 1. docker always caches.
#   BUILDAH_ISOLATION buildah/podman isolation (default chroot: works inside containers too)
#
# The torch wheel and CA certificates are staged in .image-context/ (gitignored), the one
# ignored path the build context lets in (.containerignore / .dockerignore).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONTEXT_DIR=.image-context
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CPU_BASE_DEFAULT=docker.io/library/debian:bookworm-slim
LOCAL_BASE=localhost/bookworm-local

log() { echo "image: $*" >&2; }

detect_builder() {
    if [ -n "${IMAGE_BUILDER:-}" ]; then
        echo "$IMAGE_BUILDER"
    elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        echo docker
    elif command -v buildah >/dev/null 2>&1; then
        echo buildah
    elif command -v podman >/dev/null 2>&1; then
        echo podman
    else
        log "no builder: install docker, or buildah/podman (apt-get install buildah podman)"
        return 1
    fi
}

# The storage driver of an existing containers/storage store, else vfs (the one that works
# everywhere, nested containers included). STORAGE_DRIVER wins when set.
storage_driver() {
    if [ -n "${STORAGE_DRIVER+x}" ]; then
        echo "$STORAGE_DRIVER"
        return
    fi
    local root=/var/lib/containers/storage
    [ "$(id -u)" = 0 ] || root=${XDG_DATA_HOME:-$HOME/.local/share}/containers/storage
    if [ -d "$root/overlay-images" ] && [ ! -d "$root/vfs-images" ]; then
        echo overlay
    else
        echo vfs
    fi
}

# The buildah/podman command with the storage options this machine needs.
ctr() {
    local tool=$1
    shift
    local driver
    driver=$(storage_driver)
    if [ -n "$driver" ]; then
        "$tool" --storage-driver "$driver" "$@"
    else
        "$tool" "$@"
    fi
}

image_exists() {
    case $1 in
        docker) docker image inspect "$2" >/dev/null 2>&1 ;;
        *) ctr "$1" inspect --type image "$2" >/dev/null 2>&1 ;;
    esac
}

# BASE for the CPU image: $BASE, else Debian bookworm-slim when it is here or can be pulled,
# else a local debootstrap of bookworm (scripts/make_base_image.sh).
cpu_base() {
    local builder=$1
    if [ -n "${BASE:-}" ]; then
        echo "$BASE"
        return
    fi
    if [ "$builder" = docker ]; then
        echo "$CPU_BASE_DEFAULT"
        return
    fi
    if image_exists "$builder" "$CPU_BASE_DEFAULT" ||
        timeout 120 "$builder" --storage-driver "$(storage_driver)" pull -q "$CPU_BASE_DEFAULT" \
            >/dev/null 2>&1; then
        echo "$CPU_BASE_DEFAULT"
        return
    fi
    if ! image_exists "$builder" "$LOCAL_BASE"; then
        log "$CPU_BASE_DEFAULT cannot be pulled; making $LOCAL_BASE with debootstrap"
        STORAGE_DRIVER=$(storage_driver) "$ROOT/scripts/make_base_image.sh" "$LOCAL_BASE" >&2
    fi
    echo "$LOCAL_BASE"
}

find_torch_wheel() {
    if [ -n "${TORCH_WHEEL:-}" ]; then
        [ -f "$TORCH_WHEEL" ] || { log "TORCH_WHEEL=$TORCH_WHEEL is not a file"; return 1; }
        echo "$TORCH_WHEEL"
        return
    fi
    local dir
    for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
        dir=${dir#file://}
        [ -d "$dir" ] || continue
        for whl in "$dir"/torch-"$TORCH_VERSION"+cpu-*.whl; do
            [ -f "$whl" ] && echo "$whl"
        done
    done
}

# .image-context/: wheels/ (torch CPU wheels, for the CPU image) and ca/ (build-time CAs).
stage_context() {
    local device=$1 dir="$ROOT/$CONTEXT_DIR"
    rm -rf "$dir/wheels" "$dir/ca"
    mkdir -p "$dir/wheels" "$dir/ca"
    if [ "$device" = cpu ]; then
        local whl staged=0
        while IFS= read -r whl; do
            [ -n "$whl" ] || continue
            ln "$whl" "$dir/wheels/" 2>/dev/null || cp "$whl" "$dir/wheels/"
            log "staged $(basename "$whl")"
            staged=1
        done < <(find_torch_wheel | sort -u)
        [ "$staged" = 1 ] || log "no local torch CPU wheel; the build takes it from PyTorch's CPU index"
    fi
    if [ "${IMAGE_BUILD_CA:-1}" = 1 ]; then
        local crt
        for crt in /usr/local/share/ca-certificates/*.crt; do
            [ -f "$crt" ] && cp "$crt" "$dir/ca/" && log "staged build-time CA $(basename "$crt")"
        done
    fi
    return 0
}

build() {
    local device=${1:-cuda}
    case $device in cuda | cpu) ;; *) log "device must be cuda or cpu, not $device"; exit 2 ;; esac
    local builder tag base
    builder=$(detect_builder)
    if [ "$device" = cpu ]; then
        tag=${IMAGE:-appliance:cpu}
        base=$(cpu_base "$builder")
    else
        tag=${IMAGE:-appliance:latest}
        base=${BASE:-}
    fi
    stage_context "$device"
    # The staged wheel and certificates are for this build only.
    trap 'rm -rf "${ROOT:?}/$CONTEXT_DIR"' EXIT
    local args=(-f Containerfile --build-arg "DEVICE=$device" -t "$tag")
    [ -n "$base" ] && args+=(--build-arg "BASE=$base")
    # shellcheck disable=SC2206  # word splitting is the point
    args+=(${IMAGE_BUILD_ARGS:-})
    log "building $tag (DEVICE=$device, BASE=${base:-Containerfile default}) with $builder"
    local start=$SECONDS
    cd "$ROOT"
    case $builder in
        docker) docker build "${args[@]}" . ;;
        buildah | podman)
            local verb=build layers=${IMAGE_LAYERS:-} old
            [ "$builder" = buildah ] && verb=bud
            if [ -z "$layers" ]; then
                layers=1
                [ "$(storage_driver)" = vfs ] && layers=0
            fi
            old=$(ctr "$builder" images -q --no-trunc "$tag" 2>/dev/null | head -n1 || true)
            # docker format: OCI image configs have no HEALTHCHECK.
            ctr "$builder" "$verb" --format docker --layers="$([ "$layers" = 1 ] && echo true || echo false)" \
                --isolation "${BUILDAH_ISOLATION:-chroot}" "${args[@]}" .
            # Without layer caching the image this tag had is no cache, only disk: drop it.
            if [ "$layers" = 0 ] && [ -n "$old" ] &&
                [ "$old" != "$(ctr "$builder" images -q --no-trunc "$tag" | head -n1)" ]; then
                ctr "$builder" rmi "$old" >/dev/null 2>&1 || true
            fi
            ;;
        *) log "unknown builder $builder"; exit 2 ;;
    esac
    log "built $tag in $((SECONDS - start)) s"
}

case ${1:-} in
    build) build "${2:-cuda}" ;;
    builder) detect_builder ;;
    cpu-base) cpu_base "$(detect_builder)" ;;
    storage-driver) storage_driver ;;
    *)
        sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
