"""Builds the native modules and names the packages; the metadata lives in pyproject.toml.

The native modules are optional for a source install: without a C compiler the
package still installs from the sdist; the NVMe reader falls back to a thread
pool, the gather to numpy, the daemon's Unix fast path to Python (each logs
so). Release builds set ``ENGRAM_STORE_REQUIRE_NATIVE=1`` (``make dist``, the
container image), which makes a module that does not compile fail the build.

The deploy files (``deploy/``: systemd unit, sysusers.d/tmpfiles.d, example
configs, container and Kubernetes files) ship inside the package as
``engram_store.deploy``, so an installed wheel carries them:
``python -m engram_store.deploy`` prints where they are.
"""

import os
from pathlib import Path

from setuptools import Extension, find_packages, setup

DEPLOY = "engram_store.deploy"
DEPLOY_FILES = ("*.toml", "*.conf", "*.service", "*.yaml", "*.yml", "*.json", "*.sh", "Dockerfile*")


def deploy_packages() -> tuple[dict[str, str], dict[str, list[str]]]:
    """deploy/ and each folder below it whose name is an identifier is a (data) package, so that
    setuptools ships its files; a folder such as systemd/sysusers.d ships with its parent."""
    dirs, data = {DEPLOY: "deploy"}, {DEPLOY: list(DEPLOY_FILES)}
    for d in sorted(Path("deploy").rglob("*")):
        if not d.is_dir() or d.name == "__pycache__":
            continue
        parts = d.relative_to("deploy").parts
        if all(part.isidentifier() for part in parts):
            name = ".".join((DEPLOY, *parts))
            dirs[name], data[name] = d.as_posix(), list(DEPLOY_FILES)
        else:
            keep = next(i for i, part in enumerate(parts) if not part.isidentifier())
            owner = ".".join((DEPLOY, *parts[:keep]))
            data[owner] += ["/".join((*parts[keep:], pattern)) for pattern in DEPLOY_FILES]
    return dirs, data


DEPLOY_DIRS, DEPLOY_DATA = deploy_packages()
REQUIRE_NATIVE = os.environ.get("ENGRAM_STORE_REQUIRE_NATIVE", "") == "1"


def native(extensions: list[Extension]) -> list[Extension]:
    for ext in extensions:
        ext.optional = not REQUIRE_NATIVE
    return extensions


# The C sources by concept: native/common/ (crc32c, the frame header, the staging gate, the test hooks),
# native/readers/ (Linux AIO, io_uring, the read calls' checks), native/gather/ (the gather pool, the row
# cache's epoch guard), native/gpu_runtime/ (the host-function launch), fetch/ (the engines' fetch job),
# daemon/ (the daemon's native Unix path).
# Shared code is a .c unit compiled into each extension that needs it; its header declares it, and an
# extension finds headers through include_dirs, never by relative path.
COMMON = "engram_store/native/common"
READERS = "engram_store/native/readers"
GATHER = "engram_store/native/gather"
GPU = "engram_store/native/gpu_runtime"
FETCH = "engram_store/fetch"
DAEMON = "engram_store/daemon"
# _GNU_SOURCE as pyconfig.h defines it, so that units which include no Python header see the same libc.
MACROS = [("_GNU_SOURCE", "1"), ("PY_SSIZE_T_CLEAN", None)]
HIDDEN = ["-fvisibility=hidden"]  # only PyInit_* is exported: shared units stay private to each extension


def extension(name: str, sources: list[str], include_dirs: list[str], **kw) -> Extension:
    headers = [str(p) for d in include_dirs for p in sorted(Path(d).glob("*.h"))]
    return Extension(name, sources, include_dirs=include_dirs, depends=headers, define_macros=MACROS,
                     extra_compile_args=HIDDEN, optional=True, **kw)


setup(
    packages=find_packages(include=["engram_store*", "gpu_client*"]) + list(DEPLOY_DIRS),
    package_dir=DEPLOY_DIRS,
    package_data=DEPLOY_DATA,
    ext_modules=native([
        extension("engram_store.native._pread",
                  [f"{READERS}/_pread.c", f"{READERS}/aio.c", f"{READERS}/batch.c", f"{COMMON}/crc32c.c"],
                  [READERS, COMMON]),
        extension("engram_store.native._uring", [f"{READERS}/_uring.c", f"{READERS}/batch.c", f"{COMMON}/crc32c.c"],
                  [READERS, COMMON]),
        extension("engram_store.native._gather",
                  [f"{GATHER}/_gather.c", f"{GATHER}/pool.c", f"{GATHER}/epoch_guard.c", f"{COMMON}/staging_gate.c"],
                  [GATHER, COMMON]),
        extension("engram_store.daemon._unixfast",
                  [f"{DAEMON}/_unixfast.c", f"{DAEMON}/unixfast_io.c", f"{DAEMON}/cached_hits.c",
                   f"{DAEMON}/staging_serve.c", f"{COMMON}/frame.c", f"{COMMON}/staging_gate.c"],
                  [DAEMON, GATHER, COMMON]),
        extension("engram_store.fetch._fetch",
                  [f"{FETCH}/{unit}.c" for unit in
                   ("_fetch", "core", "lifecycle", "direct_budget", "reader", "daemon", "writer", "board", "run")] +
                  [f"{READERS}/aio.c", f"{READERS}/batch.c", f"{COMMON}/crc32c.c", f"{COMMON}/frame.c",
                   f"{COMMON}/staging_gate.c", f"{COMMON}/test_hooks.c", f"{GPU}/host_launch.c"],
                  [FETCH, READERS, COMMON, GPU], libraries=["dl"]),
    ]),
)
