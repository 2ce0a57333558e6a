"""Hints: rows an engine will look up soon (a prompt's chunks not computed yet), queued for reading.

An engine that schedules a long prompt knows every row its later chunks will ask for (row ids
depend on token ids alone). It sends them as a *hint*: ``(layer, rows, key)`` from a *holder* (one
client connection) of an *owner* (the client's identity: its uid over the Unix socket, its
certificate or connection over gRPC), fire and forget. :class:`HintQueue` keeps them until the
store's hint reader (:mod:`.hint_reader`) reads their pages behind the lookups and admits the rows
into the cache's hinted share (:meth:`~.row_cache.RowCache.admit_hinted`); a chunk that comes later
finds its rows in DRAM.

- Owned: a key is its owner's. A hint whose owner, key and rows equal a queued one (the TP/DP
  ranks of one engine, one holder each, sending the same prompt) only adds its holder; another
  owner's hint of the same key and rows is a hint of its own, so it can neither withdraw nor keep
  alive what it did not send (a hint is compared with the latest :data:`ATTACH_SCAN` of its key, so
  many hints under one key cost no more than under many). Rows repeated within one hint are queued once; rows already
  cached, hinted or being read are skipped when their turn comes, so several hints of the same
  rows read each page once.
- Bounded by cost, in *row units* of 8 bytes: a hint costs its rows plus :data:`HINT_ROWS`
  (:data:`HINT_BYTES` of bookkeeping: its objects and index entries; a test measures it). At most
  ``max_queued_rows`` units queued in all, a quarter of that from one owner, whatever number of
  connections it uses (a hint past either bound is cut, its tail dropped and counted); a hint not
  read within ``max_age_seconds`` is dropped. Memory: 8 bytes a queued row plus
  :data:`HINT_BYTES` a hint, ``8 * max_queued_rows`` bytes at most. Once the queue empties after
  holding more than :data:`TRIM_AFTER_BYTES`, the heap's free pages go back to the system
  (:func:`.heap.release_free_memory`).
- Fair: owners take turns, a batch each; an owner's hints go in the order sent, each from its
  first row (a prompt's next chunk first).
- Withdrawn: :meth:`HintQueue.withdraw` (a finished or aborted request) removes the holder from
  its owner's hints of that key; a hint no holder holds any more is dropped, queued rows unread.
  A holder that goes away withdraws all it holds (:meth:`HintQueue.withdraw_holder`). Each is
  linear in the hints it drops: hints leave their indexes in O(1) (marked, and swept once dead
  entries outnumber live ones).

Counters (:class:`HintCounters`) count rows of hints (duplicates included) as they pass each
stage. Thread-safe.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field, fields

import numpy as np

from .heap import release_free_memory

HOLDER_SHARE = 4  # one owner (client) may queue at most 1/HOLDER_SHARE of max_queued_rows
ROW_BYTES = 8  # a queued row id
# bookkeeping of one queued hint (its Hint, its rows' array object, index entries by owner, key and holder),
# counted against the bound as this many rows; tests/test_hint_costs.py measures it
HINT_BYTES = 768
HINT_ROWS = HINT_BYTES // ROW_BYTES
ATTACH_SCAN = 16  # a hint is compared with this many of the latest of its owner's key at most (ranks send together)
TRIM_AFTER_BYTES = 4 << 20  # the queue emptied after holding this much: hand the heap's free pages back
# why hinted rows were not used: the queue's bounds, the client's rate, its withdraw, queued too long, read but
# never looked up before max_age_seconds, read when the hinted share was full or no slot could be freed at once
# (slots evicted while lookups read them are reused only once those end; rows lookups hit are never evicted)
DROP_REASONS = ("queue_full", "rate", "withdrawn", "aged", "expired", "no_room")
_NO_ROWS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class HintSettings:
    """How a store reads hints (the daemon's ``hint_*`` config keys)."""

    cache_share: float = 0.25  # hinted rows hold at most this share of the cache's slots; 0: hints are ignored
    queue_depth: int = 16  # hint reads in flight at most (a share of the reader's queue depth)
    max_age_seconds: float = 30.0  # queued rows not read by then are dropped; read rows not hit by then, freed
    max_queued_rows: int = 8 << 20  # row units queued, all owners together (8 bytes each; HINT_ROWS a hint)

    @property
    def enabled(self) -> bool:
        return self.cache_share > 0 and self.max_queued_rows > 0


@dataclass
class HintCounters:
    """Cumulative counters (``hint_*`` in the store's stats): rows of hints, duplicates included."""

    requests: int = 0  # hints received (one per layer, per holder)
    rows_received: int = 0  # rows in them
    rows_attached: int = 0  # rows of hints equal to a queued one of the same owner and key: a holder added
    rows_skipped: int = 0  # rows repeated within their hint, or found in DRAM (cached, hinted, resident) or being
    # read when their turn came
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


@dataclass(eq=False, slots=True)
class Hint:
    """One hint of ``owner``: ``rows`` (int64, distinct, in the order sent) of ``layer``, ``rows[:taken]``
    handed to the reader; held by ``holders`` (connections of its owner). ``live`` until read, withdrawn or
    aged (then its rows are let go and it leaves its indexes when they are swept)."""

    key: int
    layer: int
    rows: np.ndarray
    owner: str
    at: float
    holders: tuple[str, ...]
    taken: int = 0
    live: bool = True

    @property
    def left(self) -> int:
        return len(self.rows) - self.taken

    @property
    def cost(self) -> int:
        return len(self.rows) + HINT_ROWS


class _Hints:
    """An owner's hints in the order sent, with their live count and cost: a hint that dies stays until
    more than half are dead (then the dead are swept: amortized O(1) a death)."""

    __slots__ = ("hints", "live", "cost")

    def __init__(self) -> None:
        self.hints: collections.deque[Hint] = collections.deque()
        self.live = 0
        self.cost = 0  # row units of the live hints

    def append(self, hint: Hint) -> None:
        self.hints.append(hint)
        self.live += 1
        self.cost += hint.cost

    def died(self, hint: Hint) -> None:
        self.live -= 1
        self.cost -= hint.cost
        if len(self.hints) > 2 * self.live + 16:
            self.hints = collections.deque(h for h in self.hints if h.live)

    def first(self) -> Hint:
        while not self.hints[0].live:
            self.hints.popleft()
        return self.hints[0]


class _KeyHints(list):
    """An owner's hints of one key (a list: most keys have one or two), with their live count; swept as
    :class:`_Hints`."""

    __slots__ = ("live",)

    def __init__(self) -> None:
        super().__init__()
        self.live = 0

    def died(self) -> None:
        self.live -= 1
        if len(self) > 2 * self.live + 4:
            self[:] = [h for h in self if h.live]


class HintQueue:
    """The queued hints of a store, by owner in turns. Thread-safe; :meth:`take` wakes on :meth:`add`."""

    def __init__(self, settings: HintSettings, counters: HintCounters, clock=time.monotonic) -> None:
        self.settings, self.counters, self.clock = settings, counters, clock
        self.per_owner = max(1, settings.max_queued_rows // HOLDER_SHARE)
        self._by_owner: collections.OrderedDict[str, _Hints] = collections.OrderedDict()
        self._by_key: dict[str, dict[int, _KeyHints]] = {}  # owner -> key -> its hints
        # holder -> (its owner, {key: live hints of that key it holds}): what withdraw_holder withdraws
        self._holding: dict[str, tuple[str, dict[int, int]]] = {}
        self.queued_rows = 0  # rows of live hints (whole hints: their arrays are held until done)
        self.queued_cost = 0  # row units of live hints (rows + HINT_ROWS each): what the bounds count
        self._peak_cost = 0  # the most queued_cost since the heap was last trimmed
        self.trim_due = False  # the queue emptied after holding TRIM_AFTER_BYTES: see trim()
        self.cond = threading.Condition()
        self.closed = False

    # --- producers ---------------------------------------------------------------------------
    def add(self, layer: int, rows: np.ndarray, key: int, holder: str, rate_limited: int = 0,
            owner: str | None = None) -> int:
        """Queue ``rows`` (int64, checked by the caller) of ``layer`` for ``holder``, a connection of ``owner``
        (default: the holder is a client of its own); returns rows queued. Rows repeated in ``rows`` are
        queued once (the first time, counted as skipped). Equal to a queued hint of the same owner and key
        (same layer, same rows): the holder is added, nothing queued. ``rate_limited``: rows of the same hint
        the caller dropped for the client's rate (counted)."""
        owner = holder if owner is None else owner
        received = len(rows)
        self.counters.add(requests=1, rows_received=received + rate_limited)
        self.counters.drop("rate", rate_limited)
        with self.cond:  # no room for it, nothing to attach it to: dropped before any work on its rows
            if self.closed or (self._room(owner) <= 0 and key not in self._by_key.get(owner, {})):
                self.counters.drop("queue_full", received)
                return 0
        rows = _distinct(rows)
        n = len(rows)
        self.counters.add(rows_skipped=received - n)
        with self.cond:
            if self.closed:
                self.counters.drop("queue_full", n)
                return 0
            same_key = self._by_key.get(owner, {}).get(key)
            recent = itertools.islice(reversed(same_key), ATTACH_SCAN) if same_key is not None else ()
            for hint in recent:
                if hint.live and hint.layer == layer and len(hint.rows) == n and np.array_equal(hint.rows, rows):
                    if holder not in hint.holders:
                        hint.holders += (holder,)
                        self._hold(holder, owner, key, +1)
                    self.counters.add(rows_attached=n)
                    return 0
            keep = max(0, min(n, self._room(owner)))
            self.counters.drop("queue_full", n - keep)
            if not keep:
                return 0
            hint = Hint(key, layer, rows[:keep].copy() if keep < n else rows, owner, self.clock(), (holder,))
            mine = self._by_owner.get(owner)
            if mine is None:
                mine = self._by_owner[owner] = _Hints()
            mine.append(hint)
            if same_key is None:
                same_key = self._by_key.setdefault(owner, {})[key] = _KeyHints()
            same_key.append(hint)
            same_key.live += 1
            self._hold(holder, owner, key, +1)
            self.queued_rows += keep
            self.queued_cost += hint.cost
            self._peak_cost = max(self._peak_cost, self.queued_cost)
            self.cond.notify_all()
            return keep

    def withdraw(self, key: int, holder: str) -> int:
        """``holder`` no longer needs its owner's hints of ``key``: those no other holder holds are dropped.
        Returns the queued rows dropped. A key its owner did not send, or that ``holder`` does not hold, is
        left alone."""
        with self.cond:
            held = self._holding.get(holder)
            if held is None or key not in held[1]:
                return 0
            dropped = self._let_go(holder, held[0], key)
            self._hold(holder, held[0], key, -held[1][key])
        self.counters.drop("withdrawn", dropped)
        return dropped

    def withdraw_holder(self, holder: str) -> int:
        """``holder`` went away: it withdraws every hint it holds (linear in them)."""
        with self.cond:
            owner, keys = self._holding.pop(holder, (None, {}))
            dropped = sum(self._let_go(holder, owner, key) for key in keys)
        self.counters.drop("withdrawn", dropped)
        return dropped

    # --- the reader -----------------------------------------------------------------------------
    def take(self, rows: int) -> tuple[int, np.ndarray] | None:
        """The next batch for the reader: ``(layer, up to `rows` rows)`` of the next owner's oldest hint
        (owners in turns), or None when nothing is queued. Hints older than ``max_age_seconds`` are
        dropped on the way."""
        with self.cond:
            now = self.clock()
            while self._by_owner:
                owner, hints = next(iter(self._by_owner.items()))
                self._by_owner.move_to_end(owner)  # the next batch is another owner's
                hint = hints.first()
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
        """Drop every hint older than ``max_age_seconds`` (their rows unread); returns rows dropped. An
        owner's hints are in the order sent, so only the aged ones and one more per owner are looked at."""
        with self.cond:
            now, dropped = self.clock(), 0
            for owner in list(self._by_owner):
                while owner in self._by_owner:
                    hint = self._by_owner[owner].first()
                    if now - hint.at <= self.settings.max_age_seconds:
                        break
                    dropped += self._remove(hint, "aged")
            return dropped

    def wait(self, timeout: float) -> None:
        """Sleep until a hint is added or ``timeout`` passes."""
        with self.cond:
            if not self._by_owner and not self.closed:
                self.cond.wait(timeout)

    @property
    def empty(self) -> bool:
        with self.cond:
            return not self._by_owner

    def trim(self) -> bool:
        """The reader's call when it finds nothing queued: if the queue emptied after holding more than
        :data:`TRIM_AFTER_BYTES`, give the heap's free pages back (the hints' arrays and objects are freed
        but the allocator keeps them). Returns whether it did."""
        with self.cond:
            due, self.trim_due = self.trim_due and not self._by_owner, False
        return release_free_memory() if due else False

    def close(self) -> None:
        """Drop everything queued; later hints are refused."""
        with self.cond:
            self.closed = True
            for hints in list(self._by_owner.values()):
                for hint in list(hints.hints):
                    self._remove(hint, "withdrawn")
            self.cond.notify_all()

    # --- bookkeeping (cond held) ---------------------------------------------------------------------
    def _room(self, owner: str) -> int:
        """Rows one more hint of ``owner`` may queue: what is left of the queue and of the owner's quarter,
        less the hint's own bookkeeping."""
        mine = self._by_owner.get(owner)
        return min(self.settings.max_queued_rows - self.queued_cost,
                   self.per_owner - (mine.cost if mine is not None else 0)) - HINT_ROWS

    def _hold(self, holder: str, owner: str, key: int, delta: int) -> None:
        held = self._holding.get(holder)
        if held is None:
            held = self._holding[holder] = (owner, {})
        keys = held[1]
        keys[key] = keys.get(key, 0) + delta
        if not keys[key]:
            del keys[key]
            if not keys:
                del self._holding[holder]

    def _let_go(self, holder: str, owner: str, key: int) -> int:
        """``holder`` leaves its owner's hints of ``key``; those nobody holds now are removed (not counted:
        the caller counts them). Its own count in ``_holding`` is the caller's to settle."""
        same_key = self._by_key.get(owner, {}).get(key)
        dropped = 0
        for hint in list(same_key) if same_key is not None else ():
            if hint.live and holder in hint.holders:
                hint.holders = tuple(h for h in hint.holders if h != holder)
                if not hint.holders:
                    dropped += self._remove(hint, None)
        return dropped

    def _remove(self, hint: Hint, reason: str | None) -> int:  # returns rows dropped unread
        if not hint.live:
            return 0
        hint.live = False
        left = hint.left
        mine = self._by_owner[hint.owner]
        mine.died(hint)
        if not mine.live:
            del self._by_owner[hint.owner]
        keys = self._by_key[hint.owner]
        same_key = keys[hint.key]
        same_key.died()
        if not same_key.live:
            del keys[hint.key]
            if not keys:
                del self._by_key[hint.owner]
        for holder in hint.holders:
            self._hold(holder, hint.owner, hint.key, -1)
        self.queued_rows -= len(hint.rows)
        self.queued_cost -= hint.cost
        hint.rows, hint.taken = _NO_ROWS, 0  # its ids are let go now (a batch taken keeps its own view)
        if not self._by_owner and self._peak_cost * ROW_BYTES > TRIM_AFTER_BYTES:
            self.trim_due, self._peak_cost = True, 0
        if reason is not None:
            self.counters.drop(reason, left)
        return left


def _distinct(rows: np.ndarray) -> np.ndarray:
    """``rows`` with repeats left out, in the order each first appears, in an array of their own."""
    if len(rows) > 1:
        _, first = np.unique(rows, return_index=True)
        if len(first) < len(rows):
            first.sort()
            return rows[first]
    return rows.copy() if rows.base is not None else rows  # never a view holding its caller's whole array
