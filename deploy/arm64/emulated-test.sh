#!/usr/bin/env bash
# The aarch64 wheel, run for real under emulation on an x86-64 host (as root, as CI runs):
#   deploy/arm64/emulated-test.sh WHEEL
# The wheel and its dependencies' aarch64 wheels (from PyPI, by this host's pip) go into the arm64
# root of deploy/arm64/root.sh (kept under build/, dependencies included, so a second run is fast);
# qemu-user-static runs it through binfmt_misc (registered here with flag F, the magic and mask of
# Debian's /usr/lib/binfmt.d/qemu-aarch64.conf, and unregistered when done), chrooted, in a mount
# namespace of its own (/proc and /dev bound there; nothing outlives the run). Then, all aarch64
# code (Python 3.11 of Debian 12, numpy's and grpcio's aarch64 wheels, this wheel's modules):
# - the native unit tests: crc32c vectors through the ARMv8 CRC32 instructions (qemu's `max` CPU
#   has them: AT_HWCAP says so and the implementation must be armv8-crc32) and the C tables, page
#   checks, the gathers and hit-count passes, the batch readers against each other and O_DIRECT on
#   the root's disk, sealed memfds, the arena and row cache on 16/64 KiB and 512 MiB page sizes
#   given as parameters, the Unix fast path, a fetch job run from a native thread against a daemon;
# - daemons (resident, resident in Python, cached) serving byte-exact lookups over the Unix socket;
# - bench/nvme_throughput.py --crc32c-only: the ARM path against the table path in instructions
#   executed (valgrind's callgrind, aarch64, itself under qemu): emulated time means little.
# What emulation cannot run: io_uring (qemu-user 7.2 has no io_uring syscalls: the readers use Linux
# AIO, which it has, and tests/test_storage_uring.py reports its skips; the io_uring reader runs
# natively on x86-64 in `make test`, from the same C); 16 and 64 KiB kernel pages (qemu-user runs on
# the host's 4 KiB pages: the page-size code runs with those sizes as parameters instead, in
# tests/test_page_sizes.py); GPUs.
set -euo pipefail
wheel=$(realpath "${1:?usage: $0 WHEEL}")
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
root=${ARM64_ROOT:-$repo/build/arm64-root}
python=${PYTHON:-python3}
binfmt=/proc/sys/fs/binfmt_misc
name=engram-store-arm64
tests=(
    tests/test_crc32c.py tests/test_page_sizes.py tests/test_storage_nvme.py tests/test_storage_uring.py
    tests/test_cache_bookkeeping.py tests/test_bump_counts.py tests/test_unixfast.py
    "tests/test_fetch_job.py::test_twenty_steps_exact_from_the_daemon_and_from_a_native_thread"
    "tests/test_daemon_lookup.py::test_lookup_is_byte_exact"
)
if [ "$(id -u)" != 0 ]; then
    echo "$0: needs root (binfmt_misc, chroot, mount namespace)" >&2
    exit 1
fi
"$here/root.sh" "$root"
"$here/need.sh" qemu-aarch64-static qemu-user-static

mounted=0
registered=0
cleanup() {
    if [ $registered = 1 ]; then echo -1 > "$binfmt/$name"; fi
    if [ $mounted = 1 ]; then umount "$binfmt"; fi
    rm -rf "$root/opt/engram-wheel" "$root/opt/engram-tests" "$root"/tmp/* 2>/dev/null || true
}
trap cleanup EXIT
if [ ! -e "$binfmt/register" ]; then
    mount -t binfmt_misc binfmt_misc "$binfmt"
    mounted=1
fi
if [ -e "$binfmt/$name" ]; then  # left by a run that was killed
    echo -1 > "$binfmt/$name"
fi
IFS=: read -r _ _ _ _ magic mask _ < <(grep -v '^#' /usr/lib/binfmt.d/qemu-aarch64.conf)
printf ':%s:M::%s:%s:%s:F' "$name" "$magic" "$mask" "$(command -v qemu-aarch64-static)" > "$binfmt/register"
registered=1

# The wheel's dependencies (aarch64 wheels, kept while the wheel asks for the same ones), then the wheel.
site="$root/usr/local/lib/python3.11/dist-packages"
mapfile -t deps < <("$python" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
print("\n".join(sorted(l[15:] for l in meta.splitlines() if l.startswith("Requires-Dist: ") and "extra ==" not in l)))' "$wheel")
deps+=("pytest>=8")
pip_aarch64=("$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-compile
    --only-binary=:all:
    --python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_34_aarch64
    --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64)
if [ "$(cat "$site/.engram-deps" 2>/dev/null)" != "${deps[*]}" ]; then
    rm -rf "$site"
    "${pip_aarch64[@]}" --target "$site" "${deps[@]}"
    echo "${deps[*]}" > "$site/.engram-deps"
fi
rm -rf "$root/opt/engram-wheel" "$root/opt/engram-tests"
"${pip_aarch64[@]}" --no-deps --target "$root/opt/engram-wheel" "$wheel"
mkdir -p "$root/opt/engram-tests" "$root/sys"
cp -r "$repo/tests" "$repo/bench" "$repo/pyproject.toml" "$root/opt/engram-tests/"

# A fetch step's hedge budget (a few ms) and deadline (2 s) are wall-clock bounds emulation cannot meet: stretched
# here so every step is served by the daemon as natively (a step past its hedge reads its pages itself: exact, but
# not what the test checks).
env=(PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 PYTHONPATH=/opt/engram-wheel PYTHONDONTWRITEBYTECODE=1
     OPENBLAS_NUM_THREADS=1 ENGRAM_STORE_FETCH_DEADLINE_SECONDS=60 ENGRAM_STORE_FETCH_HEDGE_SECONDS=30)
script='
    set -e
    cd /opt/engram-tests
    python3 -c "import platform, engram_store, engram_store.native._pread as p; print(platform.machine(), engram_store.__file__, \"crc32c:\", p.CRC32C)"
    python3 -m pytest -q -p no:cacheprovider --durations=6 '"$(printf '"%s" ' "${tests[@]}")"'
    python3 bench/nvme_throughput.py --crc32c-only --crc32c-instructions --quick'
# shellcheck disable=SC2016
unshare --mount --propagation private -- bash -c '
    set -euo pipefail
    root=$1; shift
    mount -t proc proc "$root/proc"
    mount -t sysfs -o ro sysfs "$root/sys"  # huge page pools, THP settings
    mount --rbind /dev "$root/dev"
    exec env -i "$@"' _ "$root" "${env[@]}" "$(command -v chroot)" "$root" /bin/sh -c "$script"
