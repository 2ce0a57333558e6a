"""HINT and WITHDRAW: rows a client will look up soon, and their withdrawal.

A hint names row ids of one layer and a key (over the Unix socket, at an offset of the
client's shared region: :func:`region_hint`). :func:`hint` takes what the caller's rate
allows (``hint_rows_per_second``, a :class:`~engram_store.daemon.limits.PeerBuckets` per
transport; the rest dropped and counted, never copied), copies those ids, hands them to the
store (:meth:`~engram_store.storage.base.HintingStore.hint`: queued, never read here) and
returns the rows queued: the caller's memory is free again at once, and nothing it does
afterwards waits for a read. :func:`withdraw` drops the queued rows of a key that no other
holder of the caller holds; :func:`withdraw_holder` everything one holder sent (a Unix
connection that closes). A store without hints queues and drops nothing (0 rows).

The caller (:class:`~.context.Caller`) is what its transport vouches for. A Unix client is
its uid (``SO_PEERCRED``, :func:`owner_name`): every connection of a uid, whatever its
process, shares one rate, one share of the queue and one set of keys, which no other uid can
withdraw or keep alive (not its pid: an engine's ranks are several processes sending the same
hints, and a user may fork at will); each connection holds its own hints (:func:`holder_name`).
"""

from __future__ import annotations

import itertools
import logging

import numpy as np

from ... import errors
from ...storage.base import HintingStore
from ...wire.frames import Frame
from .context import Caller
from .lookup import check_dtype

log = logging.getLogger(__name__)

_HOLDERS = itertools.count(1)


def owner_name(uid: int) -> str:
    """A Unix client's name as the owner of hints: its uid."""
    return f"unix:uid:{uid}"


def holder_name(uid: int) -> str:
    """A Unix connection's name as a hint holder: unique in this daemon."""
    return f"{owner_name(uid)}#{next(_HOLDERS)}"


def hint(caller: Caller, layer: int, ids: np.ndarray, key: int) -> int:
    """Queue the rows of ``ids`` (checked: layer, dtype, count) that the caller's rate lets in; returns
    the rows queued. Only those ids are copied out of ``ids``: a client past its rate costs no copy."""
    granted = caller.served.hint_rates.take(caller.owner, ids.size)
    store = caller.served.store
    if not isinstance(store, HintingStore):
        return 0
    return store.hint(layer, ids[:granted].copy(), key, caller.holder, rate_limited=ids.size - granted,
                      owner=caller.owner)


def region_hint(caller: Caller, region: np.ndarray, frame: Frame) -> int:
    """A HINT whose ``count`` ids lie at ``ids_offset`` of a client's shared region (the key in
    ``out_offset``): its layer, dtype, count and extent checked (typed errors, as a lookup's),
    then :func:`hint` (which copies the ids it queues: the client may reuse its region once answered)."""
    served = caller.served
    served.check_layer(frame.layer)
    dtype = check_dtype(frame.dtype)
    served.check_count(frame.count)
    end = frame.ids_offset + frame.count * dtype.itemsize
    if end > len(region) or frame.ids_offset % 8:
        raise errors.InvalidRequest(f"hint ids [{frame.ids_offset}, {end}) fall outside the {len(region)}-byte "
                                    "shared region or do not start on a multiple of 8")
    return hint(caller, frame.layer, region[frame.ids_offset: end].view(dtype), frame.out_offset)


def withdraw(caller: Caller, key: int) -> int:
    """Drop what the caller's holder still has queued under ``key``; returns the rows dropped."""
    store = caller.served.store
    return store.withdraw(key, caller.holder) if isinstance(store, HintingStore) else 0


def withdraw_holder(caller: Caller) -> None:
    """The caller's holder is gone (a closed connection): every hint it sent is withdrawn."""
    store = caller.served.store
    if isinstance(store, HintingStore):
        try:
            store.withdraw_holder(caller.holder)
        except Exception:
            log.exception("withdrawing a closed connection's hints failed")
