"""The seam between ``EngramClient`` and a connection to the daemon: the :class:`Transport` protocol.

Two transports implement it: :class:`~.unix_transport.UnixTransport` (``unix://``: a Unix socket and
a shared region the daemon writes rows into, the resident arena mapped read-only) and
:class:`~.grpc_transport.GrpcTransport` (``grpc[s]://``: rows copied out of gRPC messages). There is
no in-process transport: :class:`~.local.LocalClient` is a client of its own over a store.
``EngramClient`` owns one transport at a time, reconnects by opening a new one, and never asks which
kind it holds: what differs is said by the members below (``region`` and ``arena`` are None where
there is no shared memory, ``reserve`` refuses there, ``submit`` returns a finished lookup over gRPC).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from ..format.arena_layout import ArenaView


class Pending(Protocol):
    """A submitted lookup. ``wait()`` returns its rows (uint8 ``row_ids.shape + (row_bytes,)``):
    over ``unix://`` a read-only view of the shared region, valid until ``release()``; over gRPC an
    owned array. ``wait()`` may be called again (same rows, or the same error); ``release()`` gives
    the region space back (after the daemon is done writing it) and is idempotent. One thread uses
    a pending lookup at a time."""

    def wait(self) -> np.ndarray: ...

    def release(self) -> None: ...


class Transport(Protocol):
    """One connection to one daemon.

    Buffers: ``out`` arrays are the caller's (uint8, C-contiguous, ``row_ids.shape + (row_bytes,)``)
    and are written only by the call they are passed to; ``region`` and ``arena`` belong to the
    transport and stay mapped until :meth:`close` (a close hook of ``EngramClient`` sees them still
    mapped). A :meth:`reserve` buffer lies in ``region`` and is the caller's until :meth:`unreserve`
    or :meth:`close`.

    Blocking: every call blocks until the daemon answered (:meth:`submit` until the request is sent
    over ``unix://``, and while the shared region has no room for it), at most ``timeout`` seconds
    per reply (then :class:`~engram_store.errors.DeadlineExceeded`); none waits for a hint's reads.

    Threads: every method may be called from several threads at once.

    Errors: :class:`~engram_store.errors.Unavailable` when the daemon cannot be reached or went away
    (``broken`` is then true, and the transport is closed and replaced by the caller);
    DeadlineExceeded (an Unavailable) past a call's deadline; the daemon's typed errors
    (``InvalidRequest``, ``OutOfRange``, ``CorruptRows``, ``ResourceExhausted`` ...) for a request it
    refused, the connection staying usable; ``InvalidRequest`` from :meth:`reserve` without shared
    memory.
    """

    kind: str  # "unix" or "grpc": Info's "transport" and the prefix of this transport's counters
    row_bytes: int
    max_request_rows: int
    info_cached: dict[str, Any]  # the daemon's Info as of connecting
    region: np.ndarray | None  # uint8 view of the shared region rows land in; None without shared memory
    arena: "ArenaView | None"  # the daemon's resident arena, mapped read-only; None where not offered

    @property
    def broken(self) -> bool:
        """True once the connection is lost (or timed out): the caller closes it and connects again."""
        ...

    def submit(self, layer: int, row_ids: np.ndarray) -> Pending:
        """Start a lookup; its rows come from ``wait()`` of the pending lookup returned."""
        ...

    def lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` with the rows of ``row_ids``; returns ``out``."""
        ...

    def lookup_planned(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``lookup_into`` in plan mode where the transport has it (this process reads cold rows from the
        layer files, every page checked), else exactly ``lookup_into``; byte-exact either way."""
        ...

    def plan_info(self) -> dict[str, Any]:
        """How plan lookups are executed: ``executor`` (``host``, or ``daemon``), ``fallbacks``
        ({layer: why the daemon reads its rows}), ``pages_read`` and ``bytes_read`` here so far."""
        ...

    def reserve(self, nbytes: int) -> np.ndarray:
        """A writable uint8 buffer of ``nbytes`` in ``region`` (``lookup_into`` into it is one copy);
        InvalidRequest where there is no shared memory."""
        ...

    def unreserve(self, buf: np.ndarray) -> None:
        """Give a :meth:`reserve` buffer back (InvalidRequest for any other buffer)."""
        ...

    def hint(self, layer: int, row_ids: np.ndarray, key: int) -> int:
        """Rows of ``layer`` to be asked for soon, under the hint ``key``; returns the rows the daemon queued."""
        ...

    def withdraw(self, key: int) -> int:
        """The hints of ``key`` are no longer needed; returns the queued rows the daemon dropped."""
        ...

    def info(self) -> dict[str, Any]:
        """The daemon's Info now."""
        ...

    def stats(self) -> dict[str, float]:
        """The daemon's counters."""
        ...

    def close(self) -> None:
        """Close the connection and unmap ``region`` and ``arena``; idempotent, never raises."""
        ...


class Finished:
    """A lookup answered by the time it was submitted (gRPC): ``wait()`` returns its rows."""

    __slots__ = ("_rows",)

    def __init__(self, rows: np.ndarray) -> None:
        self._rows = rows

    def wait(self) -> np.ndarray:
        return self._rows

    def release(self) -> None:
        pass
