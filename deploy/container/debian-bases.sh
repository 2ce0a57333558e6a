#!/usr/bin/env bash
# Base images for deploy/container/Dockerfile made from Debian 12 packages, for hosts that
# reach Debian's package archive but no container registry:
#   deploy/container/debian-bases.sh WORKDIR [RUNTIME_TAG BUILD_TAG]
# RUNTIME_TAG (default localhost/engram-store-base:bookworm): python3, python3-venv and
# libstdc++6 on Debian's essential set, no compiler. BUILD_TAG (localhost/engram-store-build-base:bookworm):
# the same plus gcc and the Python headers. Each is a root filesystem made by mmdebstrap
# (tarball in WORKDIR) and imported with `podman import`, labelled with its package list; an
# image with the same list is kept.
# Environment: PODMAN (default "podman"), MIRROR (default http://deb.debian.org/debian), ARCH (a Debian
# architecture, amd64 or arm64: bases for an image of that architecture; default this machine's; another
# one runs its packages' scripts under qemu-user-static registered in binfmt_misc).
set -euo pipefail
workdir=${1:?usage: $0 WORKDIR [RUNTIME_TAG BUILD_TAG]}
runtime_tag=${2:-localhost/engram-store-base:bookworm}
build_tag=${3:-localhost/engram-store-build-base:bookworm}
podman=${PODMAN:-podman}
mirror=${MIRROR:-http://deb.debian.org/debian}
arch=${ARCH:-$(dpkg --print-architecture)}
mkdir -p "$workdir"

make_base() {  # TAG NAME PACKAGES
    local tag=$1 name=$2 packages=$3 have
    have=$($podman image inspect --format '{{index .Labels "engram-store.packages"}}' "$tag" 2>/dev/null || true)
    if [ "$have" = "$packages" ]; then
        echo "$tag: present"
        return
    fi
    mmdebstrap --quiet --variant=essential --architectures="$arch" --include="$packages" bookworm \
        "$workdir/$name.tar" "$mirror"
    $podman import --quiet --arch "$arch" --change "LABEL engram-store.packages=$packages" "$workdir/$name.tar" "$tag" \
        >/dev/null
    rm -f "$workdir/$name.tar"
    echo "$tag: imported ($packages)"
}

# libstdc++6: numpy's wheels link it.
make_base "$runtime_tag" runtime python3,python3-venv,libstdc++6,ca-certificates
make_base "$build_tag" build python3,python3-venv,python3-dev,gcc,libc6-dev,libstdc++6,ca-certificates
