"""Least recently used, by batch: the baseline policy.

Each slot carries the stamp of the batch that last read it; eviction takes the
slots with the oldest stamps (``np.argpartition``, O(slots) per evicting
batch). Rows read in one batch tie, which is the only difference from a
per-access LRU and matters only for requests larger than the cache. A stamp is
``2 * batch`` when the row was admitted and ``2 * batch + 1`` once a lookup read
it: cold rows (never read since admitted) are those with an even stamp.
"""

from __future__ import annotations

import numpy as np

UNTRACKED = np.iinfo(np.int64).max
BYTES_PER_SLOT = 8


class LruPolicy:
    name = "lru"

    def __init__(self, n_slots: int) -> None:
        self.stamp = np.full(n_slots, UNTRACKED, dtype=np.int64)
        self.clock = 0
        self._tracked = 0

    @property
    def tracked(self) -> int:
        return self._tracked

    def insert(self, slots: np.ndarray, keys: np.ndarray, main: bool = False) -> None:
        self.clock += 1
        self.stamp[slots] = 2 * self.clock
        self._tracked += len(slots)

    def on_hit(self, slots: np.ndarray) -> None:
        self.clock += 1
        self.stamp[slots] = 2 * self.clock + 1

    def hit_counts(self) -> None:
        return None  # hits stamp a batch clock: only the Python path records them

    def evict(self, count: int, slot_keys: np.ndarray) -> np.ndarray:
        count = min(count, self._tracked)
        if count <= 0:
            return np.zeros(0, dtype=np.int32)
        victims = np.argpartition(self.stamp, count - 1)[:count].astype(np.int32)
        self.stamp[victims] = UNTRACKED
        self._tracked -= count
        return victims

    def evict_cold(self, count: int, slot_keys: np.ndarray) -> np.ndarray:
        cold = np.flatnonzero((self.stamp & 1) == 0)  # UNTRACKED is odd: never cold
        if count <= 0 or not len(cold):
            return np.zeros(0, dtype=np.int32)
        if len(cold) > count:
            cold = cold[np.argpartition(self.stamp[cold], count - 1)[:count]]
        self.stamp[cold] = UNTRACKED
        self._tracked -= len(cold)
        return cold.astype(np.int32)

    def metadata_bytes(self) -> int:
        return self.stamp.nbytes
