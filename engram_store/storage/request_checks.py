"""A store request's arguments checked against the table set: the layer, the ids' dtype and shape, ``out``.

Bounds are left to the tier that serves the rows (the resident tier's gather checks them as it copies).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..format import requests
from ..native.gather.split_out import SplitOut
from .layer_file import LayerFile


def checked_layer(files: Mapping[int, LayerFile], layer) -> LayerFile:
    """The file of ``layer``; raises UnknownLayer (or InvalidRequest) for a layer the table set does not have."""
    return files[requests.check_layer(layer, files)]


def check_request(lf: LayerFile, row_ids, out, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Dtypes and shapes (bounds come later, with the gather); returns the flat int64 ids
    and ``out`` as rows (a :class:`~engram_store.native.gather.split_out.SplitOut` as it is)."""
    ids = requests.row_ids(row_ids)
    if isinstance(out, SplitOut):  # rows into a client's staging (the daemon's Flag.SPLIT lookups)
        out.check(ids.size, row_bytes)
        return requests.flat_row_ids(ids), out
    out_rows = requests.rows_out(out, ids.shape, row_bytes)
    return requests.flat_row_ids(ids), out_rows
