"""Access profiles: files of hot row ids, written from live traffic, read for warm-up.

Format: a ``.npy`` file holding an int64 array of shape ``[n, 2]``, one
``(layer, row)`` pair per line, hottest first. Written atomically by
:meth:`TieredStore.write_profile` (the daemon does at stop, config ``save_profile``),
read by ``TieredStore.open(..., warmup=PATH)`` or :meth:`TieredStore.warm_up`
(config ``warmup_profile``).

:class:`AccessSampler` keeps a bounded ring of sampled keys from live requests
(a few rows per request, never a Python step per row).
"""

from __future__ import annotations

import io
import os
import threading

import numpy as np

from ..errors import ConfigError
from ..format.writer import write_file_atomic

SAMPLES_PER_REQUEST = 64
DEFAULT_CAPACITY = 1 << 20  # keys kept (8 MiB)


class AccessSampler:
    """Thread-safe ring of sampled ``(layer, row)`` keys."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, per_request: int = SAMPLES_PER_REQUEST) -> None:
        self.layer = np.zeros(max(capacity, 1), dtype=np.int64)
        self.row = np.zeros(max(capacity, 1), dtype=np.int64)
        self.per_request = per_request
        self.next = 0
        self.filled = 0
        self._lock = threading.Lock()

    def record(self, layer: int, rows: np.ndarray) -> None:
        if not rows.size or self.per_request <= 0:
            return
        picked = rows[:: max(1, rows.size // self.per_request)][: self.per_request]
        k, cap = len(picked), len(self.row)
        with self._lock:
            at = self.next
            if at + k <= cap:  # slices, not index arrays: this runs on every request
                self.row[at : at + k] = picked
                self.layer[at : at + k] = layer
            else:
                ring = (at + np.arange(k)) % cap
                self.row[ring] = picked
                self.layer[ring] = layer
            self.next = (at + k) % cap
            self.filled = min(cap, self.filled + k)

    def hottest(self) -> np.ndarray:
        """int64 ``[n, 2]`` distinct sampled (layer, row), most sampled first."""
        with self._lock:
            pairs = np.stack([self.layer[: self.filled], self.row[: self.filled]], axis=1)
        if not len(pairs):
            return np.zeros((0, 2), dtype=np.int64)
        distinct, counts = np.unique(pairs, axis=0, return_counts=True)
        return distinct[np.argsort(-counts, kind="stable")]

    @property
    def nbytes(self) -> int:
        return self.layer.nbytes + self.row.nbytes


def merge_hottest(*parts: np.ndarray) -> np.ndarray:
    """Concatenate ``[n, 2]`` pair lists keeping the first occurrence of each pair."""
    pairs = np.concatenate([p.reshape(-1, 2) for p in parts]) if parts else np.zeros((0, 2), dtype=np.int64)
    if not len(pairs):
        return pairs.astype(np.int64)
    _, first = np.unique(pairs, axis=0, return_index=True)
    return pairs[np.sort(first)].astype(np.int64)


def write_profile(path: str | os.PathLike, pairs: np.ndarray) -> int:
    """Write ``pairs`` (int64 ``[n, 2]``) atomically; returns n."""
    data = io.BytesIO()
    np.save(data, np.ascontiguousarray(pairs, dtype=np.int64))
    write_file_atomic(path, data.getvalue())
    return len(pairs)


def read_profile(path: str | os.PathLike) -> np.ndarray:
    """int64 ``[n, 2]`` (layer, row) pairs of a profile file; ConfigError if malformed."""
    try:
        pairs = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"access profile {path}: cannot read it ({exc}); expected a .npy int64 [n, 2] array") from exc
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype.kind not in "iu":
        raise ConfigError(f"access profile {path}: {pairs.dtype} array of shape {pairs.shape}, "
                          "expected int64 [n, 2] (layer, row)")
    return pairs.astype(np.int64)
