"""The process heap's free pages, handed back to the system (the one allocator trick of the storage tier).

Many small objects freed at once (a flood of hints withdrawn) leave glibc's heap holding their
pages: RSS stays where the flood left it. ``malloc_trim(0)`` hands back every free page, not only
the top of the heap. Probed once; where it does not exist (another libc) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        log.debug("no malloc_trim in this libc: freed heap pages stay with the process until reused")
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the system; returns whether the allocator could."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
