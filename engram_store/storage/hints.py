"""Hints: rows an engine will look up soon (a prompt's chunks not computed yet), queued for reading.

An engine that schedules a long prompt knows every row its later chunks will ask for (row ids
depend on token ids alone). It sends them as a *hint*: ``(layer, rows, key)`` from a *holder* (a
client connection), fire and forget. :class:`HintQueue` keeps them until the store's hint reader
(:mod:`.hint_reader`) reads their pages behind the lookups and admits the rows into the cache's
hinted share (:meth:`~.row_cache.RowCache.admit_hinted`); a chunk that comes later finds its rows
in DRAM.

- Deduplicated: a hint whose key and rows equal a queued one (the TP/DP ranks of one engine
  sending the same prompt) only adds its holder; rows already cached, hinted or being read are
  skipped when their turn comes, so several hints of the same rows read each page once.
- Bounded: at most ``max_queued_rows`` rows queued in all, a quarter of that from one holder (a
  hint past either bound is cut, its tail dropped and counted); a hint not read within
  ``max_age_seconds`` is dropped. Memory: 8 bytes per queued row.
- Fair: holders take turns, a batch each; a holder's hints go in the order sent, each from its
  first row (a prompt's next chunk first).
- Withdrawn: :meth:`HintQueue.withdraw` (a finished or aborted request) removes the holder from
  the hints of that key; a hint no holder holds any more is dropped, queued rows unread. A
  holder that goes away withdraws all it holds (:meth:`HintQueue.withdraw_holder`).

Counters (:class:`HintCounters`) count rows of hints (duplicates included) as they pass each
stage. Thread-safe.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field, fields

import numpy as np

HOLDER_SHARE = 4  # one holder may queue at most 1/HOLDER_SHARE of max_queued_rows
# why hinted rows were not used: the queue's bounds, the client's rate, its withdraw, queued too long, read but
# never looked up before max_age_seconds, read when the hinted share was full or no slot could be freed at once
# (slots evicted while lookups read them are reused only once those end)
DROP_REASONS = ("queue_full", "rate", "withdrawn", "aged", "expired", "no_room")


@dataclass(frozen=True)
class HintSettings:
    """How a store reads hints (the daemon's ``hint_*`` config keys)."""

    cache_share: float = 0.25  # hinted rows hold at most this share of the cache's slots; 0: hints are ignored
    queue_depth: int = 16  # hint reads in flight at most (a share of the reader's queue depth)
    max_age_seconds: float = 30.0  # queued rows not read by then are dropped; read rows not hit by then, freed
    max_queued_rows: int = 8 << 20  # rows queued, all holders together (8 bytes each)

    @property
    def enabled(self) -> bool:
        return self.cache_share > 0 and self.max_queued_rows > 0


@dataclass
class HintCounters:
    """Cumulative counters (``hint_*`` in the store's stats): rows of hints, duplicates included."""

    requests: int = 0  # hints received (one per layer, per holder)
    rows_received: int = 0  # rows in them
    rows_attached: int = 0  # rows of hints equal to a queued one of the same key: a holder added, nothing queued
    rows_skipped: int = 0  # queued rows found in DRAM (cached, hinted, resident) or being read when their turn came
    rows_read: int = 0  # distinct rows read from NVMe and admitted as hinted rows
    rows_hit: int = 0  # hinted rows a lookup read before they aged (they then stay in the cache as any row)
    pages_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: int | float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def drop(self, reason: str, rows: int) -> None:
        if rows:
            with self._lock:
                self.dropped[reason] += rows

    def snapshot(self) -> dict[str, int | float]:
        """The counters, and ``hint_rows_pending``: rows received not yet attached, skipped, read or dropped
        (queued or being read; 0 once every hint received has been dealt with)."""
        with self._lock:
            out = {f"hint_{f.name}": getattr(self, f.name) for f in fields(self) if f.name != "dropped"}
            out.update({f"hint_rows_dropped_{reason}": n for reason, n in self.dropped.items()})
            done = self.rows_attached + self.rows_skipped + self.rows_read + sum(
                n for reason, n in self.dropped.items() if reason != "expired")  # expired rows were read
        out["hint_rows_pending"] = self.rows_received - done
        return out


@dataclass(eq=False)
class Hint:
    """One hint: ``rows`` (int64, as sent) of ``layer``, ``rows[:taken]`` handed to the reader."""

    key: int
    layer: int
    rows: np.ndarray
    creator: str
    at: float
    holders: set[str] = field(default_factory=set)
    taken: int = 0

    @property
    def left(self) -> int:
        return len(self.rows) - self.taken


class HintQueue:
    """The queued hints of a store, by holder in turns. Thread-safe; :meth:`take` wakes on :meth:`add`."""

    def __init__(self, settings: HintSettings, counters: HintCounters, clock=time.monotonic) -> None:
        self.settings, self.counters, self.clock = settings, counters, clock
        self.per_holder = max(1, settings.max_queued_rows // HOLDER_SHARE)
        self._by_holder: collections.OrderedDict[str, collections.deque[Hint]] = collections.OrderedDict()
        self._by_key: dict[int, list[Hint]] = {}
        self._held = collections.Counter()  # rows queued by each creator (whole hints, until done)
        self.queued_rows = 0  # rows of live hints (whole hints: their arrays are held until done)
        self.cond = threading.Condition()
        self.closed = False

    # --- producers ---------------------------------------------------------------------------
    def add(self, layer: int, rows: np.ndarray, key: int, holder: str, rate_limited: int = 0) -> int:
        """Queue ``rows`` (int64, checked by the caller) of ``layer`` for ``holder``; returns rows queued.
        Equal to a queued hint of ``key`` (same layer, same rows): the holder is added, nothing queued.
        ``rate_limited``: rows of the same hint the caller dropped for the holder's rate (counted)."""
        n = len(rows)
        self.counters.add(requests=1, rows_received=n + rate_limited)
        self.counters.drop("rate", rate_limited)
        with self.cond:
            if self.closed:
                self.counters.drop("queue_full", n)
                return 0
            for hint in self._by_key.get(key, ()):
                if hint.layer == layer and len(hint.rows) == n and np.array_equal(hint.rows, rows):
                    hint.holders.add(holder)
                    self.counters.add(rows_attached=n)
                    return 0
            room = min(self.settings.max_queued_rows - self.queued_rows, self.per_holder - self._held[holder])
            keep = max(0, min(n, room))
            self.counters.drop("queue_full", n - keep)
            if not keep:
                return 0
            hint = Hint(key, layer, rows[:keep].copy() if keep < n else rows, holder, self.clock(), {holder})
            self._by_holder.setdefault(holder, collections.deque()).append(hint)
            self._by_key.setdefault(key, []).append(hint)
            self._held[holder] += keep
            self.queued_rows += keep
            self.cond.notify_all()
            return keep

    def withdraw(self, key: int, holder: str) -> int:
        """``holder`` no longer needs the hints of ``key``: those nobody else holds are dropped. Returns
        the queued rows dropped."""
        with self.cond:
            dropped = 0
            for hint in list(self._by_key.get(key, ())):
                hint.holders.discard(holder)
                if not hint.holders:
                    dropped += self._remove(hint, "withdrawn")
            return dropped

    def withdraw_holder(self, holder: str) -> int:
        """``holder`` went away: it withdraws every hint it holds."""
        with self.cond:
            keys = {hint.key for hints in self._by_key.values() for hint in hints if holder in hint.holders}
        return sum(self.withdraw(key, holder) for key in keys)

    # --- the reader -----------------------------------------------------------------------------
    def take(self, rows: int) -> tuple[int, np.ndarray] | None:
        """The next batch for the reader: ``(layer, up to `rows` rows)`` of the next holder's oldest hint
        (holders in turns), or None when nothing is queued. Hints older than ``max_age_seconds`` are
        dropped on the way."""
        with self.cond:
            now = self.clock()
            while self._by_holder:
                holder, hints = next(iter(self._by_holder.items()))
                self._by_holder.move_to_end(holder)  # the next batch is another holder's
                hint = hints[0]
                if now - hint.at > self.settings.max_age_seconds:
                    self._remove(hint, "aged")
                    continue
                batch = hint.rows[hint.taken: hint.taken + rows]
                hint.taken += len(batch)
                if not hint.left:
                    self._remove(hint, None)
                return hint.layer, batch
            return None

    def drop_aged(self) -> int:
        """Drop every hint older than ``max_age_seconds`` (their rows unread); returns rows dropped."""
        with self.cond:
            now = self.clock()
            aged = [h for hints in self._by_holder.values() for h in hints if now - h.at > self.settings.max_age_seconds]
            return sum(self._remove(h, "aged") for h in aged)

    def wait(self, timeout: float) -> None:
        """Sleep until a hint is added or ``timeout`` passes."""
        with self.cond:
            if not self._by_holder and not self.closed:
                self.cond.wait(timeout)

    @property
    def empty(self) -> bool:
        with self.cond:
            return not self._by_holder

    def close(self) -> None:
        """Drop everything queued; later hints are refused."""
        with self.cond:
            self.closed = True
            for hints in list(self._by_holder.values()):
                for hint in list(hints):
                    self._remove(hint, "withdrawn")
            self.cond.notify_all()

    def _remove(self, hint: Hint, reason: str | None) -> int:  # cond held; returns rows dropped unread
        hints = self._by_holder.get(hint.creator)
        if hints is None or hint not in hints:
            return 0
        hints.remove(hint)
        if not hints:
            del self._by_holder[hint.creator]
        same_key = self._by_key[hint.key]
        same_key.remove(hint)
        if not same_key:
            del self._by_key[hint.key]
        self._held[hint.creator] -= len(hint.rows)
        if not self._held[hint.creator]:
            del self._held[hint.creator]
        self.queued_rows -= len(hint.rows)
        left = hint.left
        hint.taken = len(hint.rows)
        if reason is not None:
            self.counters.drop(reason, left)
        return left
