"""What talks to the kernel or runs in C, below every other layer.

- ``syscalls``: ``O_DIRECT`` files, aligned buffers, memfds, seals, the one ``map_fd``;
- ``shm``: client regions (sealed memfds) and passing fds over a Unix socket;
- ``readers``: the page readers (``PageReader``, one module per backend, probed in
  the order io_uring, Linux AIO, threads), used by the NVMe tier and by clients
  executing read plans;
- ``gather``: the row gather pool (``_gather.c``, numpy fallback) that the daemon,
  clients reading a mapped arena and ``LocalClient`` share;
- ``_uring.c`` (io_uring reads through raw syscalls), ``_pread.c`` (Linux AIO reads),
  both checking pages with ``crc32c.h`` (the one crc32c), and ``_gather.c`` (row
  gathers; its C API in ``_gather_api.h``): optional extensions, each probed once
  where it is used, with a pure-Python fallback that logs.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)


def load(name: str, without: str) -> ModuleType | None:
    """The extension module ``name`` of this package (``_pread``, ``_uring``, ``_gather``), or None
    when it is not built; each caller's fallback (``without``: what runs instead) is logged once."""
    module, why = _import(name)
    if module is None:
        _warn(name, why, without)
    return module


@functools.cache
def _import(name: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(f"{__name__}.{name}"), ""
    except ImportError as exc:
        return None, str(exc)


@functools.cache
def _warn(name: str, why: str, without: str) -> None:
    log.warning("native module %s not built (%s); %s", name, why, without)
