"""Cache policies: the seam between the slot cache and the choice of what to keep.

A policy orders *slots* (positions in the slot arena); the cache
(:class:`engram_store.storage.row_cache.RowCache`) owns the slots, the row-to-slot
maps and the bytes. Every method takes whole batches as numpy arrays and runs
under the cache's lock, so implementations need no locking and must not loop
over rows in Python. One policy per module of this package:

- ``s3fifo`` (default): S3-FIFO (Yang et al., SOSP 2023): a small FIFO that
  filters one-hit wonders, a main CLOCK queue, a ghost set of recent evictions.
- ``lru``: least recently used by batch stamps, the baseline.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ...errors import ConfigError


class EvictionPolicy(Protocol):
    """Contract:

    - ``insert(slots, keys, main=False)``: ``slots`` (int32, distinct, not tracked
      yet) now hold the rows ``keys`` (int64 ``layer_index << 40 | row``);
      ``main=True`` marks rows known to be hot (warm-up).
    - ``on_hit(slots)``: the rows in ``slots`` were read (duplicates allowed).
    - ``evict(count, slot_keys)``: pick up to ``count`` tracked slots to free and
      stop tracking them; returns int32 slots. ``slot_keys`` maps slot -> key for
      policies that remember evicted keys. Fewer are returned only when fewer
      slots are tracked.
    - ``evict_cold(count, slot_keys)``: up to ``count`` tracked slots whose rows no lookup has read
      since they were admitted (or since the policy last aged them), stop tracking them; returns
      int32 slots, maybe fewer or none. It never takes a row with a hit recorded, never ages one
      (hit counts are left as they are) and looks at a bounded number of entries a call: the slots
      hinted rows may take (:meth:`~engram_store.storage.row_cache.RowCache.admit_hinted`), so a
      flood of hints never evicts the rows lookups keep hitting.
    - ``tracked``: number of slots the policy holds.
    - ``hit_counts()``: ``(counts, cap)`` when ``on_hit`` is exactly ``counts[slots] =
      min(counts[slots], cap - 1) + 1`` (uint8, numpy's semantics for repeated slots), so native
      readers can record hits themselves; None otherwise (their hits then take the Python path).
    """

    name: str

    @property
    def tracked(self) -> int: ...

    def insert(self, slots: np.ndarray, keys: np.ndarray, main: bool = False) -> None: ...

    def on_hit(self, slots: np.ndarray) -> None: ...

    def evict(self, count: int, slot_keys: np.ndarray) -> np.ndarray: ...

    def evict_cold(self, count: int, slot_keys: np.ndarray) -> np.ndarray: ...

    def metadata_bytes(self) -> int: ...

    def hit_counts(self) -> tuple[np.ndarray, int] | None: ...


POLICIES = ("s3fifo", "lru")


def make_policy(name: str, n_slots: int) -> EvictionPolicy:
    """A fresh policy for ``n_slots`` slots; ``name`` is one of :data:`POLICIES`."""
    if name == "s3fifo":
        from .s3fifo import S3FifoPolicy

        return S3FifoPolicy(n_slots)
    if name == "lru":
        from .lru import LruPolicy

        return LruPolicy(n_slots)
    raise ConfigError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}")


def policy_bytes_per_slot(name: str) -> int:
    """Metadata bytes a policy keeps per slot (carved out of the DRAM budget)."""
    if name == "s3fifo":
        from .s3fifo import BYTES_PER_SLOT
    elif name == "lru":
        from .lru import BYTES_PER_SLOT
    else:
        raise ConfigError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}")
    return BYTES_PER_SLOT
