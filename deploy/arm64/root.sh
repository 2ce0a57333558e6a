#!/usr/bin/env bash
# An arm64 (aarch64) Debian 12 root, for the aarch64 wheel's cross build and its emulated test:
#   deploy/arm64/root.sh ROOT
# Made by `mmdebstrap --variant=extract`: the packages are unpacked and no maintainer script runs,
# so making it needs no emulation (seconds). It holds python3 (the emulated test's interpreter),
# the Python headers and sysconfig data of aarch64 (the cross build's pyconfig.h, EXT_SUFFIX, CC),
# valgrind (instruction counts of the crc32c paths) and dash; the few files a maintainer script
# would have written (passwd, group) are written here. A root made from the same package list is
# kept (ROOT/.engram-packages), so a second run costs nothing.
# Environment: MIRROR (default http://deb.debian.org/debian). mmdebstrap is installed with apt when
# missing (as root, as CI runs).
set -euo pipefail
root=${1:?usage: $0 ROOT}
mirror=${MIRROR:-http://deb.debian.org/debian}
packages=python3,libpython3.11-dev,valgrind,dash,libstdc++6
if [ "$(cat "$root/.engram-packages" 2>/dev/null)" = "$packages" ]; then
    exit 0
fi
"$(dirname "$0")/need.sh" mmdebstrap mmdebstrap
rm -rf "$root" "$root.tmp"
mkdir -p "$(dirname "$root")"
mmdebstrap --quiet --variant=extract --architectures=arm64 --include="$packages" bookworm "$root.tmp" "$mirror"
mkdir -p "$root.tmp"/{proc,sys,dev,tmp,root,run}
chmod 1777 "$root.tmp/tmp"
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' > "$root.tmp/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$root.tmp/etc/group"
ln -sf dash "$root.tmp/bin/sh"
echo "$packages" > "$root.tmp/.engram-packages"
mv "$root.tmp" "$root"
echo "$root: arm64 root made ($packages)"
