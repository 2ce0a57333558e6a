"""The cached DRAM tier: hot rows of a table set in a slot arena.

A slot arena of ``n_slots`` rows, one int32 row-to-slot array per layer
(``slot + 1``, 0 when absent; allocated zeroed, so pages of rows never cached
cost no memory; on transparent huge pages where the host allows, as every
lookup reads them at random rows), and an eviction policy (:mod:`.policies`).

Hinted rows (:mod:`.hint_queue`: rows an engine will ask for soon, read ahead) take slots too, at most
a bounded share of them (:meth:`RowCache.admit_hinted`): a ceiling, not a quota. They take free
slots, and slots of rows the policy finds cold (no lookup read them since they were admitted or last
aged: :meth:`~.policies.EvictionPolicy.evict_cold`); never a row lookups keep hitting, so a flood of
hints leaves the lookups' working set where it was. The eviction policy does not track them, so
they neither push hot rows out one by one nor get evicted before they are used; a lookup finds them
like any row. :meth:`RowCache.settle_hints` hands the ones a lookup read to the policy (as if a lookup
had just admitted them) and frees those that aged unread.

Slots are never reused under a reader, by epochs: a lookup registers the
current epoch while it copies out of slots; evicted slots are retired with the
epoch of their eviction and go back to the free stack only once every lookup
that started at or before that epoch has finished. The lock and the epochs are
an ``EpochGuard`` (``native/gather/epoch_guard.h``) that the daemon's native Unix path
shares (:meth:`RowCache.native_views`): it serves lookups whose rows are all
cached under the same rule, without the interpreter.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from ..native import load
from ..native.syscalls import as_array, create_memfd, map_fd, zeroed_array
from .policies import make_policy

log = logging.getLogger(__name__)

LAYER_SHIFT = 40  # cache key = layer_index << LAYER_SHIFT | row


ROW_MASK = (1 << LAYER_SHIFT) - 1
ADMIT_DIVISOR = 4  # one lookup admits at most n_slots // ADMIT_DIVISOR new rows
HINT_BUCKET_SECONDS = 1.0  # hinted rows admitted within this long share one age bucket
HINTED, HINTED_READ = 1, 2  # RowCache.hint_state of a slot holding a hinted row (0: any other slot)
SLOT_POLL_SECONDS = 0.0005  # a patient admission looks for slots evicted under readers this often
_NATIVE = load("_gather", "the cache's row-to-slot lookups use numpy indexing")


class EpochGuard:
    """The lock and reader epochs where the native module is not built (the same contract as
    ``_gather.EpochGuard``, ``native/gather/epoch_guard.h``): ``with guard`` holds the lock;
    ``enter()`` / ``advance()`` / ``oldest()`` with it held, ``leave(token)`` takes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.epoch = 0
        self._active: dict[int, int] = {}

    def __enter__(self) -> "EpochGuard":
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def enter(self) -> int:
        self._active[self.epoch] = self._active.get(self.epoch, 0) + 1
        return self.epoch

    def leave(self, token: int) -> None:
        with self._lock:
            left = self._active[token] - 1
            if left:
                self._active[token] = left
            else:
                del self._active[token]

    def advance(self) -> int:
        self.epoch += 1
        return self.epoch - 1

    def oldest(self) -> int | None:
        return min(self._active) if self._active else None

    @property
    def readers(self) -> int:
        return sum(self._active.values())


class RowCache:
    """Hot rows of a table set in a slot arena. Thread-safe (one lock, vectorized work)."""

    def __init__(self, layer_rows: dict[int, int], row_bytes: int, n_slots: int, policy: str = "s3fifo",
                 *, huge: bool = True) -> None:
        if n_slots < 1:
            raise ValueError(f"a row cache needs at least one slot, got {n_slots}")
        self.row_bytes = row_bytes
        self.n_slots = n_slots
        self.layer_index = {layer: i for i, layer in enumerate(sorted(layer_rows))}
        self.maps = [zeroed_array(layer_rows[layer], np.int32, huge=huge) for layer in sorted(layer_rows)]
        self.memfd = create_memfd("engram-cache", n_slots * row_bytes, huge=huge)  # size: whole pages of its backing
        self._mm = map_fd(self.memfd.fd, self.memfd.size, writable=True, huge=huge)
        self.slots = as_array(self._mm, n_slots * row_bytes).reshape(n_slots, row_bytes)
        self.slot_key = np.full(n_slots, -1, dtype=np.int64)
        self.free = np.arange(n_slots - 1, -1, -1, dtype=np.int32)  # a stack: free[:free_top]
        self.free_top = n_slots
        self.limbo: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self.limbo_slots = 0
        self.policy = make_policy(policy, n_slots)
        self.admit_limit = max(1, n_slots // ADMIT_DIVISOR)
        self.lock = _NATIVE.EpochGuard() if _NATIVE is not None else EpochGuard()
        self.admitted = 0
        self.evicted = 0
        self.not_admitted = 0
        # per slot: 0, or a hinted row not handed to the policy yet: HINTED, HINTED_READ once a lookup read it
        # (the native path raises the policy's counts instead: see settle_hints)
        self.hint_state = np.zeros(n_slots, dtype=np.uint8)
        self.hinted_count = 0
        self.hint_admissions = 0  # goes up with every admit_hinted that put rows in (lookups compare it)
        self.hint_no_slot_at = float("-inf")  # when admit_hinted last found no free or cold slot
        self._hint_buckets: collections.deque[list] = collections.deque()  # [admitted at, [slots], [keys]]

    # --- readers -------------------------------------------------------
    def begin(self, layer: int, rows: np.ndarray) -> tuple[int, np.ndarray]:
        """Register a reader; returns its epoch token and ``slot + 1`` per row (0 = miss).
        The slots stay valid until :meth:`end` is called with the token."""
        li = self.layer_index[layer]
        with self.lock:
            token = self.lock.enter()
            if _NATIVE is not None:  # prefetched: one random read per row of a layer-sized table
                found = np.empty(len(rows), dtype=np.int32)
                _NATIVE.take_int32(self.maps[li], np.ascontiguousarray(rows, dtype=np.int64), found)
            else:
                found = self.maps[li][rows]
            hit = found[found > 0] - 1
            if len(hit) and self.hinted_count:
                hinted = self.hint_state[hit] != 0
                if hinted.any():  # hinted slots are not the policy's: mark them read instead
                    self.hint_state[hit[hinted]] = HINTED_READ
                    hit = hit[~hinted]
            if len(hit):
                self.policy.on_hit(hit)
        return token, found

    def end(self, token: int) -> None:
        self.lock.leave(token)

    # --- admission -----------------------------------------------------
    def admit(self, layer: int, rows: np.ndarray, data: np.ndarray, *, main: bool = False,
              patience: float = 0.0) -> int:
        """Offer rows just read (``rows`` distinct int64, ``data`` their bytes); returns
        how many were admitted. Rows already cached (a concurrent admission) are skipped.
        ``patience``: seconds to wait for slots evicted under readers (see :meth:`_slots`)."""
        li = self.layer_index[layer]
        with self.lock:
            new = np.flatnonzero(self.maps[li][rows] == 0)
            if len(new) > self.admit_limit:
                self.not_admitted += len(new) - self.admit_limit
                new = new[np.linspace(0, len(new) - 1, self.admit_limit).astype(np.intp)]
            if not len(new):
                return 0
            slots = self._slots(len(new), patience)
            new, slots = self._still_new(li, rows, new, slots, patience)
            self.not_admitted += len(new) - len(slots)
            new = new[: len(slots)]
            keys = np.int64(li << LAYER_SHIFT) | rows[new]
            self.slots[slots] = data[new]
            self.slot_key[slots] = keys
            self.maps[li][rows[new]] = slots + 1
            self.policy.insert(slots, keys, main=main)
            self.admitted += len(slots)
            return len(slots)

    # --- hinted rows ---------------------------------------------------------------------
    def admit_hinted(self, layer: int, rows: np.ndarray, data: np.ndarray, limit: int, now: float,
                     patience: float = 0.0) -> tuple[int, int]:
        """Put hinted rows just read (``rows`` distinct int64, ``data`` their bytes) into slots, while fewer
        than ``limit`` slots hold hinted rows; rows cached already are skipped. Slots come from the free
        stack, else from the policy's cold rows (:meth:`~.policies.EvictionPolicy.evict_cold`; never a row
        with hits); ``patience``: see :meth:`_slots`. When neither has a slot, ``hint_no_slot_at`` is set
        to ``now``. Returns (rows put in, rows found cached already)."""
        li = self.layer_index[layer]
        with self.lock:
            new = np.flatnonzero(self.maps[li][rows] == 0)
            cached = len(rows) - len(new)
            new = new[: max(0, limit - self.hinted_count)]
            if not len(new):
                return 0, cached
            slots = self._slots(len(new), patience, cold_only=True)
            if len(slots) < len(new):
                self.hint_no_slot_at = now
            wanted = len(new)
            new, slots = self._still_new(li, rows, new, slots, patience)
            cached += wanted - len(new)  # cached by someone else while this waited for slots
            new = new[: len(slots)]
            if not len(new):
                return 0, cached
            keys = np.int64(li << LAYER_SHIFT) | rows[new]
            self.slots[slots] = data[new]
            self.slot_key[slots] = keys
            self.maps[li][rows[new]] = slots + 1
            self.hint_state[slots] = HINTED
            counts = self.policy.hit_counts()
            if counts is not None:
                counts[0][slots] = 0  # the native path raises them when it serves the slot
            self.hinted_count += len(slots)
            if not self._hint_buckets or now - self._hint_buckets[-1][0] > HINT_BUCKET_SECONDS:
                self._hint_buckets.append([now, [], []])
            self._hint_buckets[-1][1].append(slots)
            self._hint_buckets[-1][2].append(keys)
            self.hint_admissions += 1
            return len(slots), cached

    def settle_hints(self, now: float, max_age: float) -> tuple[int, int]:
        """Hand the hinted rows a lookup has read to the policy (they stay cached as any row a lookup
        admitted) and free those admitted more than ``max_age`` seconds before ``now`` and never read.
        Returns (rows handed over, rows freed)."""
        with self.lock:
            if not self.hinted_count:
                self._hint_buckets.clear()
                return 0, 0
            counts = self.policy.hit_counts()
            handed = freed = 0
            kept: collections.deque[list] = collections.deque()
            for at, slot_parts, key_parts in self._hint_buckets:
                slots, keys = np.concatenate(slot_parts), np.concatenate(key_parts)
                live = (self.hint_state[slots] != 0) & (self.slot_key[slots] == keys)  # not settled, not reused
                slots, keys = slots[live], keys[live]
                read = self.hint_state[slots] == HINTED_READ
                if counts is not None:
                    read |= counts[0][slots] > 0
                if read.any():
                    self._unhint(slots[read])
                    self.policy.insert(slots[read], keys[read])
                    handed += int(np.count_nonzero(read))
                slots, keys = slots[~read], keys[~read]
                if now - at > max_age:
                    self._unhint(slots)
                    self._retire(slots, evicted=False)
                    freed += len(slots)
                elif len(slots):
                    kept.append([at, [slots], [keys]])
            self._hint_buckets = kept
            return handed, freed

    def _slots(self, n: int, patience: float, cold_only: bool = False) -> np.ndarray:  # lock held (let go to wait)
        """Up to ``n`` free slots: the free stack, then the policy's evictions (``cold_only``: of rows no lookup
        read, see :meth:`~.policies.EvictionPolicy.evict_cold`). Slots evicted while lookups are reading the
        cache come back only once those end (their epochs): with ``patience`` (seconds) the caller waits for
        them, polling, the lock released in between; without, it gets what is free."""
        slots = self._take_free(n)
        if len(slots) < n:
            evict = self.policy.evict_cold if cold_only else self.policy.evict
            self._retire(evict(n - len(slots), self.slot_key))
            slots = np.concatenate([slots, self._take_free(n - len(slots))])
        deadline = time.monotonic() + patience
        while len(slots) < n and self.limbo and time.monotonic() < deadline:
            self.lock.__exit__(None, None, None)
            try:
                time.sleep(SLOT_POLL_SECONDS)
            finally:
                self.lock.__enter__()
            slots = np.concatenate([slots, self._take_free(n - len(slots))])
        return slots

    def _still_new(self, li: int, rows: np.ndarray, new: np.ndarray, slots: np.ndarray,
                   waited: float) -> tuple[np.ndarray, np.ndarray]:  # lock held
        """After a wait for slots (the lock let go meanwhile): the rows of ``new`` nobody cached since, and
        the slots they need (the others back on the free stack)."""
        if waited:
            new = new[self.maps[li][rows[new]] == 0]
        if len(slots) > len(new):
            extra = slots[len(new):]
            self.free[self.free_top: self.free_top + len(extra)] = extra
            self.free_top += len(extra)
            slots = slots[: len(new)]
        return new, slots

    def _unhint(self, slots: np.ndarray) -> None:  # lock held
        self.hint_state[slots] = 0
        self.hinted_count -= len(slots)

    def _take_free(self, n: int) -> np.ndarray:
        self._reclaim()
        n = min(n, self.free_top)
        taken = self.free[self.free_top - n : self.free_top].copy()
        self.free_top -= n
        return taken

    def _retire(self, victims: np.ndarray, evicted: bool = True) -> None:
        if not len(victims):
            return
        keys = self.slot_key[victims]
        layer_of = keys >> LAYER_SHIFT
        for li in np.unique(layer_of):
            self.maps[li][keys[layer_of == li] & ROW_MASK] = 0
        self.slot_key[victims] = -1
        self.limbo.append((self.lock.advance(), victims))
        self.limbo_slots += len(victims)
        self.evicted += len(victims) if evicted else 0

    def _reclaim(self) -> None:
        oldest = self.lock.oldest()
        while self.limbo and (oldest is None or self.limbo[0][0] < oldest):
            _, slots = self.limbo.popleft()
            self.free[self.free_top : self.free_top + len(slots)] = slots
            self.free_top += len(slots)
            self.limbo_slots -= len(slots)

    # --- native readers ------------------------------------------------
    def native_views(self) -> dict | None:
        """What a native reader of cached rows needs (the daemon's Unix fast path), or None where the
        native module is not built or the policy's hits cannot be recorded natively:
        ``{"maps": {layer: int32 row-to-slot map}, "slots": uint8 [n_slots, row_bytes], "counts":
        uint8 hit counts, "count_cap": int, "guard": EpochGuard}``. A reader does what
        :meth:`begin` / :meth:`end` do: with the guard held, map every row (an entry of 0 is a miss),
        raise ``counts`` of the slots read to at most ``count_cap`` and enter; copy the slots after
        releasing it; then leave. It must drop the views before :meth:`close`."""
        hits = self.policy.hit_counts()
        if _NATIVE is None or hits is None:  # with _NATIVE, self.lock is its EpochGuard
            return None
        counts, cap = hits
        return {"maps": {layer: self.maps[i] for layer, i in self.layer_index.items()}, "slots": self.slots,
                "counts": counts, "count_cap": int(cap), "guard": self.lock}

    # --- introspection -------------------------------------------------
    def cached_keys(self) -> np.ndarray:
        """int64 keys of every cached row (for access profiles)."""
        with self.lock:
            return self.slot_key[self.slot_key >= 0].copy()

    @property
    def used(self) -> int:
        return self.n_slots - self.free_top - self.limbo_slots

    def metadata_bytes(self) -> int:
        """Bytes of bookkeeping per slot (slot keys, free stack, policy)."""
        return self.slot_key.nbytes + self.free.nbytes + self.hint_state.nbytes + self.policy.metadata_bytes()

    def map_bytes(self) -> int:
        return sum(m.nbytes for m in self.maps)

    @property
    def nbytes(self) -> int:
        return self.memfd.size

    def close(self) -> None:
        self.slots = np.zeros((0, self.row_bytes), dtype=np.uint8)
        try:
            self._mm.close()
        except BufferError:
            log.debug("row cache still referenced by a caller's array; unmapped when that is freed")
        self.memfd.close()
