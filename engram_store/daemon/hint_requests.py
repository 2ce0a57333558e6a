"""HINT and WITHDRAW over the Unix socket: rows a client will look up soon, and their withdrawal.

A HINT frame names ``count`` row ids of ``layer`` at ``ids_offset`` of the client's region and the
hint's key in ``out_offset`` (see :mod:`engram_store.wire.frames`). The connection's reader takes
what the client's rate allows (``hint_rows_per_second``, a :class:`~.limits.TokenBucket` per
client; the rest dropped and counted, never copied), copies those ids out of the region, hands them to the
store (:meth:`~engram_store.storage.base.HintingStore.hint`: queued, never read here) and answers
RESULT with ``count`` = the rows queued: the client's region is free again, and nothing it does
afterwards waits for a read. A WITHDRAW (``out_offset`` = a key) drops the queued rows of that key
that no other connection of the client holds; a connection that closes withdraws everything it sent.

The client is its uid (``SO_PEERCRED``, what the kernel vouches for): every connection of a uid,
whatever its process, shares one rate, one share of the queue and one set of keys, which no other
uid can withdraw or keep alive. (Not its pid: an engine's ranks are several processes sending the
same hints, and a user may fork at will.)

Errors (a bad layer, dtype, count or range, ids out of the layer) are answered like a lookup's,
with the typed status and a message; a store without hints answers OK with 0 rows.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

from .. import errors
from ..format import requests
from ..storage.base import HintingStore
from ..wire import frames as wire
from ..wire.frames import DType, Frame, Op

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger(__name__)

_HOLDERS = itertools.count(1)
_DTYPES = {DType.INT64: DType.INT64.numpy, DType.INT32: DType.INT32.numpy}


def owner_name(uid: int) -> str:
    """A Unix client's name as the owner of hints: its uid."""
    return f"unix:uid:{uid}"


def holder_name(uid: int) -> str:
    """A connection's name as a hint holder: unique in this daemon."""
    return f"{owner_name(uid)}#{next(_HOLDERS)}"


def serve_hint(conn: Connection, frame: Frame) -> None:
    store = conn.server.store
    try:
        dtype = _checked(conn, frame)
        granted = conn.server.hint_rates.take(conn.hint_owner, frame.count)
        # only the ids the rate lets in are copied out of the region: a client past its rate costs no copy
        ids = conn.array[frame.ids_offset: frame.ids_offset + granted * dtype.itemsize].view(dtype).copy()
        queued = 0
        if isinstance(store, HintingStore):
            queued = store.hint(frame.layer, ids, frame.out_offset, conn.holder,
                                rate_limited=frame.count - granted, owner=conn.hint_owner)
            conn.hinted = True
    except errors.EngramStoreError as exc:
        conn._reply_error(frame, wire.status_of(exc), str(exc))
        return
    except Exception as exc:  # a store bug must not end the connection
        log.exception("hint failed")
        conn._reply_error(frame, wire.Status.INTERNAL, f"hint failed: {exc}")
        return
    conn.send(Frame(Op.RESULT, frame.request_id, layer=frame.layer, count=queued).pack())


def serve_withdraw(conn: Connection, frame: Frame) -> None:
    store = conn.server.store
    dropped = store.withdraw(frame.out_offset, conn.holder) if isinstance(store, HintingStore) else 0
    conn.send(Frame(Op.RESULT, frame.request_id, count=dropped).pack())


def withdraw_all(conn: Connection) -> None:
    """The connection is closing: every hint it sent is withdrawn."""
    store = conn.server.store
    if conn.hinted and isinstance(store, HintingStore):
        try:
            store.withdraw_holder(conn.holder)
        except Exception:
            log.exception("withdrawing a closed connection's hints failed")


def _checked(conn: Connection, frame: Frame):
    """The numpy dtype of the hint's ids, once its layer, dtype, count and extent in the region are checked;
    typed errors for a bad request, as a lookup's. (The ids are copied out of the region: the client may
    reuse it once answered.)"""
    requests.check_layer(frame.layer, conn.server.layers)
    dtype = _DTYPES.get(frame.dtype)
    if dtype is None:
        raise errors.InvalidRequest(f"row id dtype code {frame.dtype}: expected {int(DType.INT64)} (int64) or "
                                    f"{int(DType.INT32)} (int32)")
    requests.check_count(frame.count, conn.server.config.max_request_rows)
    end = frame.ids_offset + frame.count * dtype.itemsize
    if end > len(conn.array) or frame.ids_offset % 8:
        raise errors.InvalidRequest(f"hint ids [{frame.ids_offset}, {end}) fall outside the {len(conn.array)}-byte "
                                    "shared region or do not start on a multiple of 8")
    return dtype
