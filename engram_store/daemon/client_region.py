"""Client-side bookkeeping of shared memory: the region allocator and the mapped arena."""

from __future__ import annotations

import threading
import time

import numpy as np

from .. import errors
from ..storage.arena import shared_gatherer
from ..storage.base import ArenaLayer
from . import shm

ALLOC_TIMEOUT = 30.0  # seconds a lookup waits for shared-region space before ResourceExhausted


class ClientArena:
    """The daemon's resident arena mapped read-only into this process (resident mode only)."""

    def __init__(self, region, size: int, layers: tuple[ArenaLayer, ...]) -> None:
        self._region = region
        self.array = np.frombuffer(region, dtype=np.uint8)  # read-only: the mapping is PROT_READ
        self.size = size
        self.layers = layers
        self._by_layer = {a.layer: a for a in layers}

    def layer_rows(self, layer: int) -> np.ndarray:
        """uint8 ``[rows, row_bytes]`` read-only view of one layer's rows."""
        a = self._by_layer.get(layer)
        if a is None:
            raise errors.UnknownLayer(f"layer {layer} is not in the arena; layers are {sorted(self._by_layer)}")
        return self.array[a.offset: a.offset + a.rows * a.row_bytes].reshape(a.rows, a.row_bytes)

    def gather_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray, *, threads: int = 1) -> np.ndarray:
        """Rows straight from the arena, no daemon round trip; ``threads`` copy a large
        request (1 by default: the caller's compute needs the other cores)."""
        rows = self.layer_rows(layer)
        ids = np.asarray(row_ids).reshape(-1)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise errors.InvalidRequest(f"row ids must be integers, got {ids.dtype}")
        flat_out = out.reshape(-1, rows.shape[1])
        if ids.size != flat_out.shape[0]:
            raise errors.InvalidRequest(f"out holds {flat_out.shape[0]} rows, {ids.size} row ids given")
        try:
            shared_gatherer(max(1, threads)).take(rows, ids, flat_out)  # checks the bounds as it goes
        except IndexError:
            raise errors.RowOutOfRange(f"layer {layer}: row ids must be in [0, {rows.shape[0]}), "
                                       f"got [{ids.min()}, {ids.max()}]") from None
        return out

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        shm.release(self._region)


class Extents:
    """First-fit allocator of aligned extents of the shared region."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, bytes), sorted, merged
        self.cond = threading.Condition()

    def try_alloc(self, nbytes: int) -> int | None:
        with self.cond:
            return self._take(nbytes)

    def alloc(self, nbytes: int, timeout: float = ALLOC_TIMEOUT) -> int:
        if nbytes > self.size:
            raise errors.ResourceExhausted(f"a lookup needs {nbytes} bytes of shared region, the region has {self.size}; "
                                           "use lookup_into (it splits) or connect with a larger shm_bytes")
        deadline = time.monotonic() + timeout
        with self.cond:
            while (off := self._take(nbytes)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.ResourceExhausted(f"no {nbytes} bytes of shared region free after {timeout:.0f}s: "
                                                   "release lookup views you no longer need")
                self.cond.wait(left)
            return off

    def _take(self, nbytes: int) -> int | None:
        for i, (off, size) in enumerate(self.free):
            if size >= nbytes:
                self.free[i:i + 1] = [(off + nbytes, size - nbytes)] if size > nbytes else []
                return off
        return None

    def release(self, off: int, nbytes: int) -> None:
        with self.cond:
            self.free.append((off, nbytes))
            self.free.sort()
            merged: list[tuple[int, int]] = []
            for o, s in self.free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            self.free = merged
            self.cond.notify_all()
