#!/usr/bin/env bash
# Make a Debian bookworm base image locally, for machines that reach no container registry.
#
#   scripts/make_base_image.sh [IMAGE]        (default IMAGE: localhost/bookworm-local)
#
# debootstrap a minbase bookworm into a temporary directory and `podman import` it. The result
# stands in for docker.io/library/debian:bookworm-slim as the CPU image's BASE. Needs root,
# debootstrap and podman (apt-get install debootstrap podman); about a minute.
# Env: DEBIAN_MIRROR (default http://deb.debian.org/debian), SUITE (default bookworm),
#      STORAGE_DRIVER (default vfs: the only driver that works on these machines).
set -euo pipefail

IMAGE=${1:-localhost/bookworm-local}
SUITE=${SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
DRIVER=${STORAGE_DRIVER:-vfs}

for tool in debootstrap podman; do
    command -v "$tool" >/dev/null || {
        echo "make_base_image: $tool not found (apt-get install debootstrap podman)" >&2
        exit 1
    }
done
[ "$(id -u)" = 0 ] || { echo "make_base_image: debootstrap needs root" >&2; exit 1; }

root=$(mktemp -d /var/tmp/bookworm-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
chmod 0755 "$root" # it becomes the image's /: mktemp's 0700 would lock out non-root users

echo "make_base_image: debootstrap --variant=minbase $SUITE from $MIRROR"
start=$(date +%s)
debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 || {
    tail -20 "$root.log" >&2
    rm -f "$root.log"
    exit 1
}
rm -f "$root.log"

# What debian:bookworm-slim has: updates and security suites, no apt lists or caches.
cat >"$root/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
: >"$root/etc/machine-id"

tar --numeric-owner -C "$root" -c . |
    podman --storage-driver "$DRIVER" import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' \
        - "$IMAGE" >/dev/null
echo "make_base_image: $IMAGE ready in $(($(date +%s) - start)) s"
