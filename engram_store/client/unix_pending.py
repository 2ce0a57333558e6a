"""The handle of one lookup submitted over a Unix connection, and draining handles in order.

A :class:`UnixPending` (a :class:`~.transport.Pending`) holds its request ids and its extent
of the connection's shared region: ``wait()`` returns the rows the daemon gathered there as a
read-only view (zero copy), ``release()`` gives the extent back once the daemon is done
writing it. :func:`drain_first` copies the oldest of several pending lookups into the
caller's buffer, as ``UnixTransport.lookup_into`` does with its pieces in flight.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .. import errors
from ..wire import frames as wire
from ..wire.frames import Frame
from .region import Extents


class UnixPending:
    """One submitted lookup; ``wait()`` returns a read-only view into the shared region.
    ``reply(request id)`` waits for the connection's reply to a request (``Replies.wait``);
    ``extents`` is the region's allocator the extent goes back to."""

    __slots__ = ("_reply", "_extents", "_request_ids", "_extent", "_rows", "_error", "_waited", "_released")

    def __init__(self, reply: Callable[[int], tuple[Frame, bytes]], extents: Extents, request_ids: list[int],
                 extent: tuple[int, int], rows: np.ndarray) -> None:
        self._reply, self._extents = reply, extents
        self._request_ids, self._extent, self._rows = request_ids, extent, rows
        self._error: BaseException | None = None
        self._waited = False
        self._released = False

    def wait(self) -> np.ndarray:
        if not self._waited:
            self._waited = True
            for rid in self._request_ids:
                try:
                    frame, payload = self._reply(rid)
                except errors.EngramStoreError as exc:
                    self._error = self._error or exc
                    if isinstance(exc, errors.Unavailable):
                        break
                    continue
                if frame.status and self._error is None:  # Status.OK is 0
                    self._error = wire.error_of(frame.status, payload.decode(errors="replace"))
        if self._error is not None:
            raise self._error
        return self._rows

    def release(self) -> None:
        """Give the extent back (waits for the daemon to be done writing it first)."""
        if self._released:
            return
        try:
            self.wait()
        except errors.EngramStoreError:
            pass
        self._released = True
        self._rows = None  # type: ignore[assignment]
        self._extents.release(*self._extent)

    def __enter__(self) -> np.ndarray:
        return self.wait()

    def __exit__(self, *exc: object) -> None:
        self.release()


def drain_first(inflight: list[tuple[int, UnixPending]], flat: np.ndarray) -> None:
    """Wait for the first of ``inflight`` (``(first row, pending)``), copy its rows into ``flat``
    from that row on, and release it (also when waiting failed)."""
    start, p = inflight.pop(0)
    try:
        rows = p.wait()
        flat[start: start + len(rows)] = rows.reshape(-1, flat.shape[1])
    finally:
        p.release()
