"""Builds the optional native modules; all metadata lives in pyproject.toml.

``optional=True``: without a C compiler the package still installs; the NVMe
reader falls back to a thread pool, the gather to numpy, the daemon's Unix
fast path (``_unixfast``, which needs ``_gather``) to Python (each logs so).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("engram_store.native._pread", ["engram_store/native/_pread.c"],
              depends=["engram_store/native/crc32c.h", "engram_store/native/batch.h"], optional=True),
    Extension("engram_store.native._uring", ["engram_store/native/_uring.c"],
              depends=["engram_store/native/crc32c.h", "engram_store/native/batch.h"], optional=True),
    Extension("engram_store.native._gather", ["engram_store/native/_gather.c"],
              depends=["engram_store/native/_gather_api.h"], optional=True),
    Extension("engram_store.daemon._unixfast", ["engram_store/daemon/_unixfast.c"],
              depends=["engram_store/native/_gather_api.h"], optional=True),
])
