"""The seams of the storage engine, as Protocols whose docstrings are contracts.

- :class:`RowStore`: what any backend serves; the daemon serves from it and
  in-process users (``LocalClient``) call it. ``TieredStore`` and ``MemoryTables``
  implement it; anything with this shape (a test double) can stand in for it.
- :class:`ResidentStore`: what the daemon's native Unix fast path needs besides:
  the arena's blocks to gather from in C, and a way to account for what it served.
  ``TieredStore`` implements it (its views are empty in cached mode).
- :class:`ProfiledStore`: a store that can write its hottest rows as an access
  profile (the daemon's ``save_profile``, read back by ``warmup_profile``).
- :class:`PlanningStore`: a store that can answer with a read plan of its cold rows.
- :class:`DeferringStore`: a store whose lookups can leave their cache admission until after the reply.
- :class:`HintingStore`: a store that reads ahead the rows it is told lookups will ask for soon.

The other seams of the engine sit with their implementations: the page readers
(:class:`engram_store.native.readers.PageReader`, one module per backend) and the cache policies
(:class:`.policies.EvictionPolicy`, one module per policy).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from ..format.arena_layout import ArenaInfo, ArenaLayer, ArenaLayout
from ..models.spec import ModelSpec
from .stats import LookupStats

__all__ = ["ArenaInfo", "ArenaLayer", "ArenaLayout", "DeferringStore", "HintingStore", "LookupStats", "PlanningStore",
           "ProfiledStore", "ResidentStore", "RowStore"]


@runtime_checkable
class RowStore(Protocol):
    """Serves row bytes of a table set. Thread-safe: any number of threads may call
    ``lookup_into`` at once; every method may be called from any thread.

    Contract of ``lookup_into(layer, row_ids, out)``:
    - ``row_ids``: integer ndarray of any shape (int64 preferred; other integer
      dtypes are accepted and converted); ``out``: C-contiguous writable uint8
      ndarray of shape ``row_ids.shape + (row_bytes,)``, owned by the caller.
    - On return, ``out[i] == bytes of row row_ids[i]`` for every i; duplicates
      are allowed. Nothing else in ``out`` and nothing of the store changes
      visibly to other callers.
    - Raises ``UnknownLayer`` / ``RowOutOfRange`` / ``InvalidRequest`` (see
      ``engram_store.errors``) before touching ``out`` for bad input,
      ``CorruptRows`` when a row sits in a page that failed its crc32c (no
      unverified byte is ever returned) and ``StorageError`` when a tier cannot
      read (other layers keep working).
    - Blocks until the bytes are there (NVMe reads included). Returns what the
      call cost (:class:`LookupStats`: rows from DRAM and NVMe, pages, seconds), or None
      where the store keeps no per-call counters (``MemoryTables``).
    """

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers the table set has (servable or not: see :meth:`layer_errors`)."""
        ...

    @property
    def row_bytes(self) -> int: ...

    @property
    def spec(self) -> ModelSpec:
        """The model spec of the table set."""
        ...

    @property
    def mode(self) -> str:
        """``"resident"`` (every row in DRAM), ``"cached"`` (a DRAM cache over NVMe) or
        ``"mixed"`` (some layers each way: see :meth:`placement`)."""
        ...

    def placement(self) -> dict[int, str]:
        """``{layer: "resident" | "cached"}`` for every layer. The arena (:meth:`arena`)
        holds exactly the resident ones."""
        ...

    def rows(self, layer: int) -> int: ...

    def lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> LookupStats | None: ...

    def lookup(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        """``lookup_into`` a new array."""
        ...

    def expect(self, rows: int) -> None:
        """A hint, never required: a lookup of ``rows`` rows is about to come (a request
        frame has arrived), so idle helper threads can wake while the caller parses it.
        Returns at once; a store with nothing to wake does nothing."""
        ...

    def arena(self) -> ArenaInfo | None:
        """The sealed read-only arena in resident mode, else None."""
        ...

    def layer_errors(self) -> dict[int, str]:
        """Layers that cannot be served, with the reason (``{}`` when all can)."""
        ...

    def bad_pages(self) -> dict[int, list[list[int]]]:
        """Pages known corrupt, ``{layer: [[first_page, end_page), ...]}``; their rows are
        refused. A reader of the resident arena in place must skip them itself."""
        ...

    def stats(self) -> "dict[str, int | float]":
        """Cumulative counters, units in the names: requests, rows_dram, rows_nvme,
        bytes_dram, bytes_nvme, nvme_pages_read, nvme_read_seconds, cache_slots,
        cache_slots_used, arena_bytes, ..."""
        ...

    def close(self) -> None:
        """Wait for lookups in flight, then release files, threads and memory. Idempotent."""
        ...


@runtime_checkable
class ResidentStore(RowStore, Protocol):
    """A :class:`RowStore` whose resident arena, and row cache, a caller may gather from
    with its own native code (the daemon's Unix fast path, ``_unixfast.c``).

    - ``resident_views()``: each servable layer's two blocks in the sealed arena,
      read-only ``(weights uint8 [rows, dim], scales uint8 [rows, scale_count])``;
      ``{}`` when there is no arena (cached mode) or after ``close``. A layer with a
      corrupt page is left out, so that its lookups take ``lookup_into``, which
      refuses its bad rows. The caller checks every id against ``rows(layer)`` and
      stops using the views before ``close``.
    - ``gather_threads``: threads one large gather may use.
    - ``record_native_lookup(layer, ids, seconds)``: counts a lookup the caller
      served from either views (stats, access sampling); any thread, never blocks long.
    - ``cached_views()``: the row cache as ``RowCache.native_views`` describes it, for
      the servable cached layers only (``maps``), or None (no cache, or none a native
      reader may use). A lookup whose rows are all cached may be served from it under
      that contract; any other goes to ``lookup_into``. Not used after ``close``.
    """

    def resident_views(self) -> dict[int, tuple[np.ndarray, np.ndarray]]: ...

    def cached_views(self) -> dict | None: ...


    @property
    def gather_threads(self) -> int: ...

    def record_native_lookup(self, layer: int, ids: np.ndarray, seconds: float) -> None: ...


@runtime_checkable
class DeferringStore(RowStore, Protocol):
    """A :class:`RowStore` whose lookups can leave their cache admission to the caller.

    ``lookup_into_deferred(layer, row_ids, out)`` is ``lookup_into`` (same contract, same errors)
    except that rows it read from NVMe are not offered to the cache yet: it returns ``(stats,
    admit)``, ``admit`` a callable that offers them (None when there is nothing to offer), which
    the caller runs once, from any thread, after it has answered (the daemon: once the reply is
    sent). Not running it only costs hits; it does nothing once the store is closed.
    """

    def lookup_into_deferred(self, layer: int, row_ids: np.ndarray, out: np.ndarray): ...


@runtime_checkable
class HintingStore(RowStore, Protocol):
    """A :class:`RowStore` that reads ahead rows it is told lookups will ask for soon (hints).

    - ``hint(layer, row_ids, key, holder, rate_limited=0, owner=None) -> int``: queue ``row_ids`` (any
      integer array, in the order they will be asked for) of ``layer`` as hint ``key`` of ``holder`` (one
      connection of the client ``owner``: its identity, whatever connection it uses; default: the
      holder is a client of its own); returns the rows queued (0: none needed, a resident layer, hints
      off, bounds reached). Bounds are per owner; a key is its owner's. ``rate_limited``: more rows of
      the hint the caller dropped (counted). Never waits for a read. Raises ``UnknownLayer`` /
      ``RowOutOfRange`` / ``InvalidRequest`` for bad input, ``StorageError`` for an unavailable layer or
      a closed store. The store reads the rows later, behind its lookups, within its own bounds
      (memory, queue depth, a share of its cache).
    - ``withdraw(key, holder) -> int``: ``holder`` no longer needs its owner's hints of ``key``; returns
      the queued rows dropped (those no other holder holds). ``withdraw_holder(holder)``: all of its hints.
    - ``hints_idle() -> bool``: nothing queued and nothing being read.
    """

    def hint(self, layer: int, row_ids: np.ndarray, key: int, holder: str, *, rate_limited: int = 0,
             owner: str | None = None) -> int: ...

    def withdraw(self, key: int, holder: str) -> int: ...

    def withdraw_holder(self, holder: str) -> int: ...

    def hints_idle(self) -> bool: ...


@runtime_checkable
class ProfiledStore(RowStore, Protocol):
    """A :class:`RowStore` that samples its traffic and can write the hottest rows.

    ``write_profile(path)`` writes int64 ``[n, 2]`` (layer, row) pairs, hottest first,
    as a ``.npy`` file, atomically (temp file, fsync, rename: never a half-written
    profile); returns n. Raises OSError when the file cannot be written.
    """

    def write_profile(self, path: str) -> int: ...


@runtime_checkable
class PlanningStore(RowStore, Protocol):
    """A :class:`RowStore` that can answer a lookup with a read plan (plan mode).

    ``plan_into(layer, ids, out, max_plan_bytes=N)`` copies the rows it holds in DRAM into
    ``out`` and returns the :class:`~engram_store.wire.frames.ReadPlan` of the others, unread
    (their rows in ``out`` untouched), or None when it wrote every row (a resident layer, all
    cached, a plan over ``max_plan_bytes``). Rows of pages known corrupt raise ``CorruptRows``.
    The planned rows may be admitted into DRAM later, in the background; never blocks on them.

    ``layer_files()``: per servable layer, the files it reads (path and identity: st_dev, st_ino,
    size; a striped layer's stripes in order), its checksum file and the zlib crc32 of the page
    checksums it checks against: what a same-host client needs to read and check pages itself
    (the engines' fetch jobs, when the daemon is gone).
    """

    def plan_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray, *, max_plan_bytes: int): ...

    def layer_files(self) -> dict[int, dict]: ...
