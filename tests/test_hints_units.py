"""The parts of hints, one at a time: the queue's bounds, turns, dedupe, withdrawals and ages (a fake clock);
the cache's hinted share (bounded, never evicted by the policy, handed to it once read, freed unread at
its age, for both policies); the per-client token bucket; the store reading a hint behind a lookup."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support.storage_helpers import FLASH, cache_budget, check_rows, make_tables

from engram_store.daemon.limits import PeerBuckets, TokenBucket
from engram_store.storage.hint_queue import HINT_ROWS, HintCounters, HintQueue, HintSettings
from engram_store.storage.row_cache import RowCache
from engram_store.storage.tiered import TieredStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def queue(max_rows: int = 1000, age: float = 10.0) -> tuple[HintQueue, HintCounters, Clock]:
    counters, clock = HintCounters(), Clock()
    return HintQueue(HintSettings(max_queued_rows=max_rows, max_age_seconds=age), counters, clock), counters, clock


def rows(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def test_queue_bounds_overall_and_per_holder():
    q, c, _ = queue(4000)
    kept = 1000 - HINT_ROWS  # a quarter of the queue per client, a hint costing its rows and HINT_ROWS
    assert q.add(14, rows(1200), key=1, holder="a") == kept
    assert q.add(14, rows(400, 5000), key=2, holder="a") == 0
    for i, holder in enumerate("bcd"):
        assert q.add(14, rows(1100, 10_000 + 2000 * i), key=3 + i, holder=holder) == kept
    assert q.add(14, rows(10, 90_000), key=9, holder="e") == 0  # 4000 row units queued: full
    assert q.queued_rows == 4 * kept and q.queued_cost == 4000
    snap = c.snapshot()
    assert snap["hint_rows_dropped_queue_full"] == (1200 - kept) + 400 + 3 * (1100 - kept) + 10
    assert snap["hint_rows_received"] == 1200 + 400 + 3300 + 10 and snap["hint_rows_pending"] == 4 * kept


def test_holders_take_turns_and_a_hint_goes_in_order():
    q, _, _ = queue(100_000)
    q.add(14, rows(10), key=1, holder="a")
    q.add(14, rows(10, 100), key=2, holder="a")
    q.add(1, rows(5, 500), key=3, holder="b")
    got = [q.take(4) for _ in range(6)]
    assert [(layer, r.tolist()) for layer, r in got] == [
        (14, [0, 1, 2, 3]), (1, [500, 501, 502, 503]), (14, [4, 5, 6, 7]), (1, [504]), (14, [8, 9]), (14, [100, 101, 102, 103])]
    assert q.take(100)[1].tolist() == list(range(104, 110)) and q.take(1) is None and q.queued_rows == 0


def test_an_equal_hint_of_the_same_key_adds_a_holder_and_withdrawals_count_holders():
    q, c, _ = queue(100_000)
    assert q.add(14, rows(50), key=7, holder="rank0", owner="engine") == 50
    assert q.add(14, rows(50), key=7, holder="rank1", owner="engine") == 0  # the same rows: attached
    assert q.add(14, rows(50, 1), key=7, holder="rank2", owner="engine") == 50  # other rows, same key: its own hint
    assert c.snapshot()["hint_rows_attached"] == 50
    assert q.withdraw(7, "rank0") == 0  # rank1 still holds the first hint
    assert q.withdraw(7, "rank1") == 50
    assert q.withdraw_holder("rank2") == 50 and q.empty
    assert c.snapshot()["hint_rows_dropped_withdrawn"] == 100


def test_a_key_is_its_owners():
    """Another client's equal hint of the same key neither attaches to the owner's (keeping it alive after the
    owner withdraws) nor lets it withdraw the owner's; its own hint is its own (issue 37, item 5)."""
    q, c, _ = queue(100_000)
    assert q.add(14, rows(50), key=7, holder="a#1", owner="a") == 50
    assert q.add(14, rows(50), key=7, holder="b#1", owner="b") == 50  # not attached: b's own hint
    assert c.snapshot()["hint_rows_attached"] == 0
    assert q.withdraw(7, "b#2") == 0  # a connection of b that holds nothing
    assert q.withdraw(7, "b#1") == 50 and q.queued_rows == 50  # b's hint only
    assert q.withdraw(8, "a#1") == 0  # a key a never sent
    assert q.withdraw(7, "a#1") == 50 and q.empty  # the owner's withdraw drops all it sent


def test_bounds_are_per_owner_across_its_connections():
    """Five connections of one client share one client's quarter; another client still gets its own."""
    q, _, _ = queue(4000)
    queued = sum(q.add(14, rows(900, 10_000 * i), key=i, holder=f"a#{i}", owner="a") for i in range(5))
    assert queued == 900 and q.queued_cost == 900 + HINT_ROWS  # the first hint; the others past a's quarter
    assert q.add(14, rows(900, 90_000), key=1, holder="b#1", owner="b") == 900


def test_rows_repeated_in_a_hint_are_queued_once():
    q, c, _ = queue(100_000)
    hint = np.concatenate([np.full(100_000, 5), rows(3, 7), np.full(10, 7), rows(2)])
    assert q.add(14, hint, key=1, holder="a") == 6  # 100k copies of one row queue one row (issue 37, item 5)
    assert q.take(100)[1].tolist() == [5, 7, 8, 9, 0, 1]  # each where it first appears
    assert c.snapshot()["hint_rows_skipped"] == len(hint) - 6


def test_hints_age_out_unread():
    q, c, clock = queue(100_000, age=10.0)
    q.add(14, rows(20), key=1, holder="a")
    assert len(q.take(5)[1]) == 5
    clock.now += 11
    q.add(14, rows(3, 100), key=2, holder="b")
    assert q.drop_aged() == 15
    assert q.take(100)[1].tolist() == [100, 101, 102]
    assert c.snapshot()["hint_rows_dropped_aged"] == 15


def test_token_bucket_grants_a_seconds_worth_then_the_rate():
    clock = Clock()
    bucket = TokenBucket(1000, clock=clock)
    assert bucket.take(600) == 600 and bucket.take(600) == 400 and bucket.take(1) == 0
    clock.now += 0.25
    assert bucket.take(1000) == 250
    clock.now += 100
    assert bucket.take(5000) == 1000  # never more than the burst saved up
    peers = PeerBuckets(10, max_peers=2)
    assert peers.take("a", 50) == 10 and peers.take("a", 5) == 0 and peers.take("b", 3) == 3
    peers.take("c", 1)  # "a" is forgotten: a fresh bucket next time
    assert peers.take("a", 50) == 10


@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
def test_hinted_share_is_bounded_kept_from_the_policy_handed_over_once_read(policy):
    n_slots, rb = 100, 8
    cache = RowCache({14: 10_000}, rb, n_slots, policy, huge=False)
    try:
        data = lambda r: np.repeat(r.astype(np.uint8)[:, None], rb, axis=1)  # noqa: E731
        plain = rows(n_slots, 5000)
        for lo in range(0, n_slots, cache.admit_limit):  # a full cache of looked-up rows
            cache.admit(14, plain[lo:lo + cache.admit_limit], data(plain[lo:lo + cache.admit_limit]))
        hinted = rows(40)
        assert cache.admit_hinted(14, hinted, data(hinted), limit=30, now=0.0) == (30, 0)  # the share's bound
        assert cache.admit_hinted(14, hinted[:5], data(hinted[:5]), limit=99, now=0.0) == (0, 5)  # cached already
        assert cache.hinted_count == 30 and cache.used == n_slots
        for lo in range(0, 300, cache.admit_limit):  # lookups churning: the policy never evicts a hinted row
            more = rows(cache.admit_limit, 7000 + lo)
            cache.admit(14, more, data(more))
        found = cache.maps[0][hinted[:30]]  # still there (looked at without a lookup: none of them is read yet)
        assert (found > 0).all()
        np.testing.assert_array_equal(cache.slots[found[:10] - 1], data(hinted[:10]))
        token, _ = cache.begin(14, hinted[:10])  # a lookup reads ten of them
        cache.end(token)
        assert cache.settle_hints(now=1.0, max_age=5.0) == (10, 0)  # read: handed to the policy
        assert cache.hinted_count == 20
        assert cache.settle_hints(now=10.0, max_age=5.0) == (0, 20)  # aged unread: freed
        assert cache.hinted_count == 0
        token, found = cache.begin(14, hinted[:30])
        cache.end(token)
        assert (found[:10] > 0).all() and (found[10:30] == 0).all()
    finally:
        cache.close()


def test_native_hits_count_as_reads_of_hinted_rows():
    cache = RowCache({14: 1000}, 8, 50, "s3fifo", huge=False)
    try:
        hinted = rows(10)
        cache.admit_hinted(14, hinted, np.zeros((10, 8), np.uint8), limit=20, now=0.0)
        counts, _ = cache.policy.hit_counts()
        with cache.lock:  # what the daemon's native path does for an all-hit lookup
            slots = cache.maps[0][hinted[:4]] - 1
            counts[slots] += 1
        assert cache.settle_hints(now=1.0, max_age=5.0) == (4, 0)
    finally:
        cache.close()


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("hint-units"), FLASH)


def test_the_store_reads_a_hint_behind_a_lookup_and_shares_its_pages(tables):
    layer = FLASH.layers[-1]
    with TieredStore.open(tables, dram_bytes=cache_budget(FLASH, 0.5), mode="cached") as store:
        ids = np.random.default_rng(8).choice(FLASH.rows(layer), 3000, replace=False)
        out = np.empty((3000, FLASH.row_bytes), np.uint8)
        barrier = threading.Barrier(2)

        def look() -> None:
            barrier.wait()
            store.lookup_into(layer, ids, out)

        t = threading.Thread(target=look)
        t.start()
        barrier.wait()
        store.hint(layer, ids, key=1, holder="h")
        t.join()
        deadline = 200
        while not store.hints_idle() and deadline:
            deadline -= 1
            threading.Event().wait(0.05)
        check_rows(store, tables, FLASH, layer, ids, out)
        st = store.stats()
        assert st["hint_rows_pending"] == 0
        # every row was read once, by the lookup or the hint reader (or shared): never both
        assert st["nvme_rows_distinct"] + st["hint_rows_read"] + st["nvme_rows_shared"] == 3000
        again = store.lookup_into(layer, ids, np.empty_like(out))
        assert again.rows_nvme == 0


def test_a_patient_admission_gets_the_slots_a_reader_held():
    """Slots evicted while a lookup reads the cache come back when it ends: an impatient admission into a full
    cache gets none of them, a patient one waits for the reader and gets them all."""
    cache = RowCache({14: 10_000}, 8, 40, "s3fifo", huge=False)
    try:
        full = rows(40, 5000)
        for lo in range(0, 40, cache.admit_limit):
            cache.admit(14, full[lo:lo + cache.admit_limit], np.zeros((cache.admit_limit, 8), np.uint8))
        token, _ = cache.begin(14, full[:1])  # a reader holds an epoch
        assert cache.admit(14, rows(5), np.zeros((5, 8), np.uint8)) == 0  # its victims are not reusable yet
        threading.Timer(0.02, cache.end, args=(token,)).start()
        assert cache.admit(14, rows(5, 100), np.zeros((5, 8), np.uint8), patience=5.0) == 5
        assert cache.admit_hinted(14, rows(3, 200), np.zeros((3, 8), np.uint8), limit=10, now=0.0,
                                  patience=1.0) == (3, 0)
    finally:
        cache.close()


@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
def test_hinted_rows_never_evict_rows_lookups_hit(policy):
    """A cache holding a hot set lookups keep reading, a few cold rows and some free slots: a flood of hinted
    rows takes the free and cold slots only, however large its share (issue 37, item 2)."""
    n_slots, rb = 1000, 8
    cache = RowCache({14: 100_000}, rb, n_slots, policy, huge=False)
    try:
        data = lambda r: np.zeros((len(r), rb), np.uint8)  # noqa: E731
        hot, cold = rows(700, 10_000), rows(100, 50_000)
        for part in (hot[:250], hot[250:500], hot[500:], cold):
            cache.admit(14, part, data(part))
        for _ in range(2):  # lookups read the hot set
            token, found = cache.begin(14, hot)
            cache.end(token)
            assert (found > 0).all()
        flood = rows(5000, 70_000)
        put = sum(cache.admit_hinted(14, flood[lo:lo + 100], data(flood[lo:lo + 100]), limit=600, now=0.0)[0]
                  for lo in range(0, len(flood), 100))
        assert put == 300  # 200 free slots and 100 cold rows, not the share's 600
        assert cache.hint_no_slot_at == 0.0  # the hint reader pauses instead of reading rows it cannot keep
        assert (cache.maps[0][hot] > 0).all() and (cache.maps[0][cold] == 0).all()
        settled = cache.settle_hints(now=100.0, max_age=5.0)  # unread, aged: their slots free again
        assert settled == (0, 300) and cache.hinted_count == 0 and (cache.maps[0][hot] > 0).all()
    finally:
        cache.close()


def test_rows_a_lookup_takes_from_the_hint_readers_read_count_as_that_read_not_as_shared(tables):
    """A lookup missing rows the hint reader is reading waits for that read and takes its rows: they are
    the hint reader's read (hint_rows_read counts them), not the lookup's NVMe reads and not shared rows."""
    from engram_store.format.tableset import TableSet

    layer = FLASH.layers[-1]
    with TieredStore.open(tables, dram_bytes=cache_budget(FLASH, 0.5), mode="cached") as store:
        ids = np.random.default_rng(9).choice(FLASH.rows(layer), 3000, replace=False)
        hinted = np.sort(ids[:500])
        ts = TableSet.open(tables)
        rows = ts.read_rows(layer, hinted)
        ts.close()
        inflight = store.parts.inflight
        read, _, _ = inflight.claim(layer, hinted, hint=True)  # the hint reader's read, in flight
        out = np.empty((3000, FLASH.row_bytes), np.uint8)
        t = threading.Thread(target=store.lookup_into, args=(layer, ids, out))
        t.start()
        threading.Event().wait(0.3)  # the lookup reads its other rows and waits for the hint read's
        inflight.done(read, rows)
        t.join()
        check_rows(store, tables, FLASH, layer, ids, out)
        st = store.stats()
        assert st["nvme_rows_shared"] == 0 and st["nvme_rows_distinct"] == 3000 - 500, st
