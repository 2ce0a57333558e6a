"""What a valid lookup is, checked in one place by every reader of rows.

A lookup names a layer, an integer array of row ids of any shape and (for
``lookup_into``) an output array of shape ``ids.shape + (row_bytes,)``. The
store (``TieredStore``), the in-process tables (``MemoryTables``), the mapped
arena (``ArenaView``), the reference reader (``TableSet``), both client
transports and the daemon's two front ends all check their part of it with the
functions below, so a bad request gets the same typed error, with the same
words, wherever it is caught. Each check is vectorized (a dtype test, one
min/max): nothing loops over rows.
"""

from __future__ import annotations

from typing import Any, Collection

import numpy as np

from ..errors import InvalidRequest, ResourceExhausted, RowOutOfRange, UnknownLayer

_INT64_MAX = np.iinfo(np.int64).max


def check_layer(layer: Any, layers: Collection[int]) -> int:
    """``layer`` as an int, or UnknownLayer when it is not one of ``layers`` (bools and
    non-integers included)."""
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)) or int(layer) not in layers:
        raise UnknownLayer(f"layer {layer!r} is not served; layers are {sorted(layers)}")
    return int(layer)


def row_ids(ids: Any) -> np.ndarray:
    """``ids`` as an ndarray (no copy when it is one), or InvalidRequest when its dtype is
    not an integer type (an empty array of any dtype is accepted)."""
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if arr.dtype.kind not in "iu" and arr.size:  # np.issubdtype costs ~5 us a call on the hot path
        raise InvalidRequest(f"row ids must be an integer array (int64 preferred), got dtype {arr.dtype}")
    return arr


def flat_row_ids(ids: Any) -> np.ndarray:
    """:func:`row_ids`, flattened to int64 (a copy only when the dtype differs). uint64 ids
    beyond int64 are out of any range (RowOutOfRange)."""
    arr = row_ids(ids)
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT64_MAX:
        raise RowOutOfRange(f"row id {int(arr.max())} is outside every layer (beyond int64)")
    return arr.reshape(-1).astype(np.int64, copy=False)


def rows_out(out: Any, shape: tuple[int, ...], row_bytes: int) -> np.ndarray:
    """``out`` viewed as ``[n, row_bytes]`` rows, or InvalidRequest unless it is a writable
    C-contiguous uint8 ndarray of shape ``shape + (row_bytes,)``."""
    want = tuple(shape) + (row_bytes,)
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != want:
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise InvalidRequest(f"out must be a uint8 ndarray of shape {want} (row_ids.shape + (row_bytes,)), got {got}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidRequest("out must be C-contiguous and writable; pass np.empty(shape, np.uint8) or a contiguous slice")
    return out.reshape(-1, row_bytes)


def rows_buffer(out: Any, n: int, row_bytes: int) -> np.ndarray:
    """``out`` of any shape viewed as ``[n, row_bytes]`` rows (a caller's device-shaped
    buffer, say ``[tokens, heads, row_bytes]``), or InvalidRequest unless it is a writable
    C-contiguous uint8 ndarray of exactly ``n * row_bytes`` bytes."""
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.size != n * row_bytes \
            or not out.flags.c_contiguous or not out.flags.writeable:
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise InvalidRequest(f"out must be a writable C-contiguous uint8 ndarray of {n} rows of {row_bytes} bytes, "
                             f"got {got}")
    return out.reshape(n, row_bytes)


def check_bounds(layer: int, flat: np.ndarray, rows: int) -> None:
    """RowOutOfRange naming the first bad id unless every id of ``flat`` is in ``[0, rows)``."""
    if not flat.size:
        return
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= rows:
        bad = lo if lo < 0 else hi
        raise RowOutOfRange(f"layer {layer}: row id {bad} is outside [0, {rows}); ids seen span [{lo}, {hi}]")


def check_count(count: int, max_rows: int) -> None:
    """ResourceExhausted when one request asks more rows than ``max_rows`` (``max_request_rows``)."""
    if count > max_rows:
        raise ResourceExhausted(f"{count} rows asked; at most {max_rows} per request (max_request_rows)")


def check_lookup(layer: Any, layers: Collection[int], rows: int | None, row_bytes: int, ids: Any,
                 out: Any) -> tuple[int, np.ndarray, np.ndarray]:
    """The whole ``lookup_into(layer, ids, out)`` contract of ``RowStore``: returns (layer,
    flat int64 ids, ``out`` as rows). ``rows``: the layer's row count, or None to look it up
    after the layer check (pass ``layers`` as a mapping of layer -> rows then)."""
    layer = check_layer(layer, layers)
    arr = row_ids(ids)
    out_rows = rows_out(out, arr.shape, row_bytes)
    flat = flat_row_ids(arr)
    check_bounds(layer, flat, layers[layer] if rows is None else rows)  # type: ignore[index]
    return layer, flat, out_rows
