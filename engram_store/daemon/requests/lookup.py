"""LOOKUP: rows of one layer, by row id, into the caller's memory.

:func:`rows_into` is the lookup itself, whatever carried it: ``store.lookup_into(layer,
ids, out)``, or, when the caller will run it after its reply, with the store's cache
admission of the rows it read left to a callable (a ``DeferringStore``).

A request that names its ids and rows by offsets into a client's shared region (the
Unix socket's) is checked by :func:`check_region` and served by :func:`region_into` (or
:func:`region_plan`, for ``Flag.PLAN``): the ids are copied out of the region first (the
client could rewrite them mid-gather), the rows written straight into it. A plan lookup
(see :mod:`engram_store.wire.frames`) writes the rows in DRAM and returns a read plan of
the others for the client to execute; a store without plans, or a resident layer, answers
with every row as usual (no ``Flag.PLAN`` in the RESULT).
"""

from __future__ import annotations

import numpy as np

from ... import errors
from ...format import requests
from ...storage.base import RowStore
from ...wire import frames as wire
from ...wire.frames import DType, Frame
from .context import Served

ID_DTYPES = {DType.INT64: DType.INT64.numpy, DType.INT32: DType.INT32.numpy}  # a frame's dtype code -> its ids


def rows_into(store: RowStore, layer: int, ids: np.ndarray, out: object, later: list | None = None) -> None:
    """The rows of ``ids`` into ``out``. With ``later`` (a list), a store that can leaves its cache
    admission of the rows it read to a callable appended there, for the caller to run after its reply."""
    deferred = getattr(store, "lookup_into_deferred", None) if later is not None else None  # DeferringStore
    if deferred is not None:
        _, admit = deferred(layer, ids, out)
        if admit is not None:
            later.append(admit)
        return
    store.lookup_into(layer, ids, out)


def check_dtype(code: int) -> np.dtype:
    """The numpy dtype of a frame's row ids; InvalidRequest for another code."""
    dtype = ID_DTYPES.get(code)
    if dtype is None:
        raise errors.InvalidRequest(f"row id dtype code {code}: expected "
                                    f"{int(DType.INT64)} (int64) or {int(DType.INT32)} (int32)")
    return dtype


def check_region(served: Served, frame: Frame, region_bytes: int) -> None:
    """Raise the typed error of a region lookup that cannot be served; cheap checks before any work."""
    requests.check_layer(frame.layer, served.layers)  # not served.check_*: this runs once a lookup
    dtype = ID_DTYPES.get(frame.dtype) or check_dtype(frame.dtype)
    requests.check_count(frame.count, served.max_request_rows)
    ids_end = frame.ids_offset + frame.count * dtype.itemsize
    out_end = frame.out_offset + frame.count * served.store.row_bytes
    if ids_end > region_bytes or out_end > region_bytes:
        raise errors.InvalidRequest(f"ids [{frame.ids_offset}, {ids_end}) or rows [{frame.out_offset}, {out_end}) "
                                    f"fall outside the {region_bytes}-byte shared region")
    if frame.ids_offset % 8 or frame.out_offset % 8:
        raise errors.InvalidRequest("ids_offset and out_offset must be multiples of 8")
    if frame.count and frame.ids_offset < out_end and frame.out_offset < ids_end:
        raise errors.InvalidRequest("the row ids and the rows overlap in the shared region")


def region_into(store: RowStore, region: np.ndarray, frame: Frame, start: int, stop: int,
                later: list | None = None) -> None:
    """Rows ``start:stop`` of a checked region lookup into the region (``later``: see :func:`rows_into`)."""
    dtype = ID_DTYPES[frame.dtype]
    first = frame.ids_offset + start * dtype.itemsize
    ids = region[first: first + (stop - start) * dtype.itemsize].view(dtype).copy()
    rb = store.row_bytes
    out = region[frame.out_offset + start * rb: frame.out_offset + stop * rb].reshape(stop - start, rb)
    rows_into(store, frame.layer, ids, out, later)


def region_plan(store: RowStore, region: np.ndarray, frame: Frame) -> wire.ReadPlan | None:
    """A checked region lookup with ``Flag.PLAN`` (a ``PlanningStore``): the cache's rows into the
    region, and the read plan of the others (None when every row was written)."""
    dtype = ID_DTYPES[frame.dtype]
    ids = region[frame.ids_offset: frame.ids_offset + frame.count * dtype.itemsize].view(dtype).copy()
    rb = store.row_bytes
    out = region[frame.out_offset: frame.out_offset + frame.count * rb].reshape(frame.count, rb)
    return store.plan_into(frame.layer, ids, out, max_plan_bytes=wire.MAX_DAEMON_PAYLOAD)
