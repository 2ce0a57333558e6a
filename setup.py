"""Builds the optional native reader; all metadata lives in pyproject.toml.

``optional=True``: without a C compiler the package still installs and the
storage engine falls back to its thread-pool reader (and logs so).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("engram_store.storage._pread", ["engram_store/storage/_pread.c"], optional=True),
    Extension("engram_store.storage._gather", ["engram_store/storage/_gather.c"], optional=True),
])
