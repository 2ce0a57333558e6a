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


setup(
    packages=find_packages(include=["engram_store*", "gpu_client*"]) + list(DEPLOY_DIRS),
    package_dir=DEPLOY_DIRS,
    package_data=DEPLOY_DATA,
    ext_modules=native([
        Extension("engram_store.native._pread", ["engram_store/native/_pread.c"],
                  depends=["engram_store/native/crc32c.h", "engram_store/native/batch.h", "engram_store/native/aio.h"],
                  optional=True),
        Extension("engram_store.native._uring", ["engram_store/native/_uring.c"],
                  depends=["engram_store/native/crc32c.h", "engram_store/native/batch.h"], optional=True),
        Extension("engram_store.native._gather", ["engram_store/native/_gather.c"],
                  depends=["engram_store/native/_gather_api.h", "engram_store/native/epoch_guard.h",
                           "engram_store/native/staging_gate.h", "engram_store/native/gather_staging.h"],
                  optional=True),
        Extension("engram_store.daemon._unixfast", ["engram_store/daemon/_unixfast.c"],
                  depends=["engram_store/native/_gather_api.h", "engram_store/native/frame.h",
                           "engram_store/daemon/cached_hits.h", "engram_store/native/staging_gate.h",
                           "engram_store/daemon/staging_serve.h"], optional=True),
        Extension("engram_store.native._fetch", ["engram_store/native/_fetch.c"],
                  depends=["engram_store/native/crc32c.h", "engram_store/native/batch.h", "engram_store/native/aio.h",
                           "engram_store/native/frame.h", "engram_store/native/fetch_core.h",
                           "engram_store/native/fetch_reader.h", "engram_store/native/fetch_daemon.h",
                           "engram_store/native/fetch_run.h", "engram_store/native/fetch_board.h",
                           "engram_store/native/fetch_writer.h", "engram_store/native/fetch_budget.h",
                           "engram_store/native/gpu_runtime.h", "engram_store/native/staging_gate.h"],
                  libraries=["dl"], optional=True),
    ]),
)
