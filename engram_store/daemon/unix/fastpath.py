"""The native path for lookups over the Unix socket, and when the daemon uses it.

A connection's reader hands its socket to :class:`NativeConn` (``_unixfast.c``):
it reads frame headers, checks them, copies the ids, gathers rows into the
client's region and sends the RESULT without the interpreter, from the resident
arena, or from the row cache for a cached layer when every row of the lookup is
cached (``cached_hits.h``, under the cache's own lock and reader epochs).
Whatever it does not take (another op, a frame with a payload, int32 ids, a
cached lookup with a miss, any request the checks or the bounds refuse) comes
back as a header for the Python reader, which answers it exactly as before,
errors included.

Used when ``unix_native`` is on, both native modules are built and agree with
:mod:`wire`, and the store serves resident or cached views
(``TieredStore.resident_views``, ``cached_views``); otherwise the Python reader
does everything.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
from types import ModuleType
from typing import Any

import numpy as np

from ...storage.base import ResidentStore, RowStore
from ...wire import frames as wire
from ...wire import staging
from ..config import DaemonConfig

log = logging.getLogger(__name__)

IDS_START_ROWS = 8192  # row ids a connection's copy buffer holds at first; it grows to the largest request
SERVED, FRAME, EOF = 0, 1, 2  # what NativeConn.next() returns first


@functools.cache
def native_module() -> ModuleType | None:
    """``_unixfast`` if it is built, else None (logged). Raises ProtocolError when it was
    built from another frame layout than :mod:`engram_store.wire.frames` declares."""
    try:
        from .. import _unixfast
    except ImportError as exc:
        log.warning("native Unix path _unixfast not built (%s); resident lookups go through Python", exc)
        return None
    wire.check_native_layout(_unixfast.FRAME_FIELDS, "engram_store/daemon/_unixfast.c")  # raises: a stale build
    expected = {"MAGIC": wire.MAGIC, "VERSION": wire.VERSION, "OP_LOOKUP": wire.Op.LOOKUP, "OP_RESULT": wire.Op.RESULT,
                "DTYPE_INT64": wire.DType.INT64, "FLAG_SPLIT": wire.Flag.SPLIT, "SPLIT_PAD_ID": staging.PAD_ID,
                "SERVED": SERVED, "FRAME": FRAME, "EOF": EOF}
    wrong = {k: (getattr(_unixfast, k), int(v)) for k, v in expected.items() if getattr(_unixfast, k) != v}
    if wrong:
        raise wire.ProtocolError(f"engram_store/daemon/_unixfast.c disagrees with engram_store/wire/frames.py "
                                 f"(C, Python): {wrong}; rebuild the native modules (pip install -e .)")
    return _unixfast


class PollToken:
    """The one busy-poll token of the process: at most one connection, native or Python,
    spins on its socket at a time (the others sleep in the kernel). With ``_unixfast``
    built, the token is the C module's own flag, so its connections and the Python
    ones share it; without, a lock."""

    def __init__(self) -> None:
        self._native = native_module()
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        """Take the token if it is free; never blocks."""
        if self._native is not None:
            return self._native.poll_token_try()
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        if self._native is not None:
            self._native.poll_token_release()
        else:
            self._lock.release()


class NativePath:
    """What the native path serves, shared by every connection of one daemon."""

    def __init__(self, module: ModuleType, store: ResidentStore, config: DaemonConfig,
                 views: dict[int, tuple[np.ndarray, np.ndarray]], cached: dict | None) -> None:
        self.module, self.store, self.config, self.views, self.cached = module, store, config, views, cached
        self.threads = int(store.gather_threads)

    @classmethod
    def for_store(cls, store: RowStore, config: DaemonConfig) -> "NativePath | None":
        if not config.unix_native or not isinstance(store, ResidentStore):
            return None
        module = native_module()
        if module is None:
            return None
        views, cached = store.resident_views(), store.cached_views()
        return cls(module, store, config, views, cached) if views or cached else None

    def connect(self, sock: socket.socket, region: np.ndarray) -> "NativeConn":
        return NativeConn(self, sock, region)


class NativeConn:
    """One connection served natively. Only its reader thread may call it."""

    def __init__(self, path: NativePath, sock: socket.socket, region: np.ndarray) -> None:
        self.path, self._sock, self._region = path, sock, region
        self.ids = np.empty(IDS_START_ROWS, dtype=np.int64)
        self._staging: Any = None
        self._conn = self._open()

    def _open(self) -> Any:
        cfg, store = self.path.config, self.path.store
        conn = self.path.module.Conn(self._sock.fileno(), self._region, self.ids, self.path.views,
                                     store.row_bytes, store.spec.row_format.payload_bytes, self.path.threads,
                                     cfg.max_request_rows, cfg.busy_poll_us * 1000, self.path.cached)
        if self._staging is not None:
            conn.set_staging(self._staging.weights, self._staging.scales, self._staging.gate)
        return conn

    def set_staging(self, client_staging: Any) -> None:
        """The client's staging (``daemon/requests/staging.ClientStaging``): Flag.SPLIT lookups served here write
        into it. Released with :meth:`close`, before the staging is unmapped."""
        self._staging = client_staging
        self._conn.set_staging(client_staging.weights, client_staging.scales, client_staging.gate)

    def next(self) -> tuple:
        """``(SERVED, layer, count, seconds)`` after answering a lookup (its ids are
        ``self.ids[:count]`` until the next call), ``(FRAME, header)`` for the Python
        reader, or ``(EOF, partial)``; OSError when the socket fails."""
        return self._conn.next()

    def record(self, layer: int, count: int, seconds: float) -> None:
        self.path.store.record_native_lookup(layer, self.ids[:count], seconds)

    def fit(self, frame: wire.Frame) -> None:
        """Grow the id buffer when ``frame`` is a lookup too large for it (the Python
        reader serves that one; the next of its size comes through here). Never beyond
        ids the client's region can hold: a client cannot make it larger than its region."""
        if frame.op == wire.Op.LOOKUP and len(self.ids) < frame.count <= self.path.config.max_request_rows \
                and frame.count * 8 <= len(self._region):
            self._conn.close()
            rows = min(max(frame.count, 2 * len(self.ids)), len(self._region) // 8, self.path.config.max_request_rows)
            self.ids = np.empty(rows, dtype=np.int64)
            self._conn = self._open()

    def close(self) -> None:
        """Release the region, arena and staging buffers (before the region is unmapped)."""
        self._conn.close()
        self._region = self._staging = None

