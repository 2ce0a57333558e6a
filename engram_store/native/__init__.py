"""What talks to the kernel or runs in C, below every other layer; one folder or module per concept.

- ``syscalls``: ``O_DIRECT`` files, aligned buffers, memfds, seals, the one ``map_fd``;
- ``pagesizes``: the page sizes a mapping gets (huge pages, transparent or not);
- ``shm``: client regions (sealed memfds) and passing fds over a Unix socket;
- ``readers/``: the page readers (``PageReader`` in ``base``, one module per backend, probed in the
  order io_uring, Linux AIO, threads), used by the NVMe tier and by clients executing read plans; its C:
  ``_uring.c`` (io_uring through raw syscalls), ``_pread.c`` (Linux AIO reads), and the units they share
  with the fetch job, ``aio.c`` (Linux AIO) and ``batch.c`` (the read calls' checks, page checks, row
  copies);
- ``gather/``: the row gather (``native_gather``, numpy fallback) that the daemon, clients reading a
  mapped arena and ``LocalClient`` share, and ``split_out`` (rows into a client's staging); its C:
  ``_gather.c`` (the module), ``pool.c`` (one copy path for every layout, on a native thread pool),
  ``epoch_guard.c`` (the row cache's lock and reader epochs), ``gather_api.h`` (its C API for the
  daemon's native path);
- ``gpu_runtime/``: the GPU-runtime seam (CUDA or ROCm, probed in Python) and ``host_launch.c``, its C
  side for the fetch job;
- ``common/``: C shared by several extensions, each a ``.c`` unit with a header of prototypes:
  ``crc32c`` (the one crc32c), ``frame`` (the Unix frame header), ``staging_gate`` (a client staging's
  gate), ``test_hooks`` (the fault hooks tests turn on, the one place they are declared).

The extensions keep their names in this package (``engram_store.native._pread``, ``_uring``,
``_gather``; setup.py names each one's sources and include folders): optional, each probed once where
it is used (:func:`load`), with a pure-Python fallback that logs. The engines' fetch job is its own
package, :mod:`engram_store.fetch`.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)


def load(name: str, without: str, package: str = __name__) -> ModuleType | None:
    """The extension module ``name`` of ``package`` (this one's: ``_pread``, ``_uring``, ``_gather``;
    ``engram_store.fetch``'s ``_fetch``), or None when it is not built; each caller's fallback
    (``without``: what runs instead) is logged once."""
    module, why = _import(f"{package}.{name}")
    if module is None:
        _warn(name, why, without)
    return module


@functools.cache
def _import(dotted: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(dotted), ""
    except ImportError as exc:
        return None, str(exc)


@functools.cache
def _warn(name: str, why: str, without: str) -> None:
    log.warning("native module %s not built (%s); %s", name, why, without)
