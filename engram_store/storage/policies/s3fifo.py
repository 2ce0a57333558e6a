"""S3-FIFO, batched: a small FIFO, a main CLOCK queue and a ghost set.

Why this policy for n-gram rows: most rows a corpus touches are read once (a
long tail of rare n-grams, prefill scans), a few are read constantly (common
n-grams, an agent's hot set). S3-FIFO admits every new row into a *small* FIFO
(10 % of slots); a row read again while there moves to the *main* queue, the
others leave after a short stay and are remembered in the *ghost* set, so a
row that comes back soon goes straight to main. One-hit wonders therefore
never push hot rows out, which is what plain LRU gets wrong on Zipf and scan
mixes (see ``bench/lookup.py`` for hit rates against LRU and Belady).

Hinted rows (read ahead of lookups) take only cold slots (:meth:`S3FifoPolicy.evict_cold`):
entries read by no lookup since they entered their queue or were last passed by the CLOCK
hand; the rows lookups keep hitting are rotated past untouched (their counts kept), so a flood
of hints neither evicts nor ages them.

Everything works on batches: a window of queue entries is examined with numpy
per round, and a round frees as many slots as the batch needs, so the cost is
a few vector operations per request, never a Python step per row.
"""

from __future__ import annotations

import numpy as np

from ...native import load

FREQ_MAX = 3
_NATIVE = load("_gather", "S3-FIFO counts hits with numpy indexing")
SMALL_FRACTION = 0.10
GHOST_FRACTION = 0.90
MIN_WINDOW = 256
MAX_ROUNDS = 64  # after this many rounds of one evict() call, take entries regardless of frequency
COLD_ROUNDS = 4  # windows of each queue one evict_cold() call looks at, at most
# freq 1 + two int32 rings + ghost (one uint32 per entry, table up to 2x its capacity)
BYTES_PER_SLOT = 1 + 8 + 8


class Ring:
    """A FIFO of int32 slot ids in a circular array of fixed capacity."""

    def __init__(self, capacity: int) -> None:
        self.buf = np.zeros(max(capacity, 1), dtype=np.int32)
        self.head = 0
        self.count = 0

    def push(self, items: np.ndarray) -> None:
        n = len(items)
        if not n:
            return
        cap = len(self.buf)
        if self.count + n > cap:
            raise OverflowError(f"ring of {cap} entries cannot take {n} more (holds {self.count})")
        start = (self.head + self.count) % cap
        first = min(n, cap - start)
        self.buf[start : start + first] = items[:first]
        self.buf[: n - first] = items[first:]
        self.count += n

    def peek(self, n: int) -> np.ndarray:
        n = min(n, self.count)
        cap = len(self.buf)
        first = min(n, cap - self.head)
        if first == n:
            return self.buf[self.head : self.head + n].copy()
        return np.concatenate([self.buf[self.head :], self.buf[: n - first]])

    def pop(self, n: int) -> None:
        self.head = (self.head + n) % len(self.buf)
        self.count -= n


class GhostSet:
    """Keys evicted recently, as a direct-mapped table of 32-bit fingerprints.

    A key added stays until a later key lands on its entry, so it survives ``k``
    further additions with probability about ``exp(-k / size)``: a soft window of
    roughly ``capacity`` recent evictions in 4 bytes per entry. False positives
    need an equal 32-bit fingerprint on the same entry (about one in 2^32).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self.bits = max(int(self.capacity - 1).bit_length(), 1)
        self.fp = np.zeros(1 << self.bits, dtype=np.uint32)

    def _hash(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(over="ignore"):
            h = keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            h ^= h >> np.uint64(29)
            h *= np.uint64(0xBF58476D1CE4E5B9)
        index = (h >> np.uint64(64 - self.bits)).astype(np.intp)
        fingerprint = (h & np.uint64(0xFFFFFFFF)).astype(np.uint32) | np.uint32(1)
        return index, fingerprint

    def add(self, keys: np.ndarray) -> None:
        if len(keys):
            index, fingerprint = self._hash(keys)
            self.fp[index] = fingerprint

    def contains(self, keys: np.ndarray) -> np.ndarray:
        index, fingerprint = self._hash(keys)
        return self.fp[index] == fingerprint

    @property
    def nbytes(self) -> int:
        return self.fp.nbytes


class S3FifoPolicy:
    name = "s3fifo"

    def __init__(self, n_slots: int, small_fraction: float = SMALL_FRACTION, ghost_fraction: float = GHOST_FRACTION) -> None:
        self.n_slots = n_slots
        self.small_target = max(1, int(n_slots * small_fraction))
        self.freq = np.zeros(n_slots, dtype=np.uint8)
        self.small = Ring(n_slots)
        self.main = Ring(n_slots)
        self.ghost = GhostSet(max(1, int(n_slots * ghost_fraction)))

    @property
    def tracked(self) -> int:
        return self.small.count + self.main.count

    def insert(self, slots: np.ndarray, keys: np.ndarray, main: bool = False) -> None:
        self.freq[slots] = 0
        if main:
            self.main.push(slots)
            return
        seen = self.ghost.contains(keys)
        self.main.push(slots[seen])
        self.small.push(slots[~seen])

    def on_hit(self, slots: np.ndarray) -> None:
        if _NATIVE is not None:
            _NATIVE.bump_uint8(self.freq, np.ascontiguousarray(slots), FREQ_MAX)  # the same, in one native pass
            return
        f = self.freq[slots]
        self.freq[slots] = np.minimum(f, FREQ_MAX - 1) + 1

    def hit_counts(self) -> tuple[np.ndarray, int]:
        return self.freq, FREQ_MAX

    def evict(self, count: int, slot_keys: np.ndarray) -> np.ndarray:
        victims: list[np.ndarray] = []
        need = count
        rounds = 0
        while need > 0 and self.tracked:
            rounds += 1
            force = rounds > MAX_ROUNDS
            if self.small.count and (self.small.count >= self.small_target or not self.main.count):
                freed = self._evict_small(need, slot_keys)
            else:
                freed = self._evict_main(need, force)
            victims.append(freed)
            need -= len(freed)
        return np.concatenate(victims) if victims else np.zeros(0, dtype=np.int32)

    def evict_cold(self, count: int, slot_keys: np.ndarray) -> np.ndarray:
        victims: list[np.ndarray] = []
        need = count
        for ring, small in ((self.small, True), (self.main, False)):
            total, seen = ring.count, 0  # one turn of the queue at most
            for _ in range(COLD_ROUNDS):
                if need <= 0 or seen >= total:
                    break
                window = ring.peek(min(self._window(ring, need), total - seen))
                cold = self.freq[window] == 0
                cut = self._cut(cold, need)
                window, cold = window[:cut], cold[:cut]
                ring.pop(cut)
                ring.push(window[~cold])  # hit rows go round, their counts as they were
                gone = window[cold]
                if small:
                    self.ghost.add(slot_keys[gone])
                victims.append(gone)
                need -= len(gone)
                seen += cut
        return np.concatenate(victims) if victims else np.zeros(0, dtype=np.int32)

    def _window(self, ring: Ring, need: int) -> int:
        return min(ring.count, max(4 * need, MIN_WINDOW))

    @staticmethod
    def _cut(cold: np.ndarray, need: int) -> int:
        """Entries to consume so that at most ``need`` of them are cold."""
        positions = np.flatnonzero(cold)
        return int(positions[need - 1]) + 1 if len(positions) >= need else len(cold)

    def _evict_small(self, need: int, slot_keys: np.ndarray) -> np.ndarray:
        window = self.small.peek(self._window(self.small, need))
        cold = self.freq[window] == 0
        cut = self._cut(cold, need)
        window, cold = window[:cut], cold[:cut]
        self.small.pop(cut)
        promoted = window[~cold]
        self.freq[promoted] = 0
        self.main.push(promoted)
        gone = window[cold]
        self.ghost.add(slot_keys[gone])
        return gone

    def _evict_main(self, need: int, force: bool) -> np.ndarray:
        window = self.main.peek(self._window(self.main, need))
        f = self.freq[window]
        cold = np.ones(len(window), dtype=bool) if force else f == 0
        cut = self._cut(cold, need)
        window, cold = window[:cut], cold[:cut]
        self.main.pop(cut)
        kept = window[~cold]
        self.freq[kept] -= 1
        self.main.push(kept)
        return window[cold]

    def metadata_bytes(self) -> int:
        return self.freq.nbytes + self.small.buf.nbytes + self.main.buf.nbytes + self.ghost.nbytes
