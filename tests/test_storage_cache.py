"""The row cache and its policies: slot reuse under readers, churn with threads, S3-FIFO vs LRU."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support.storage_helpers import SEED, TINY, cache_budget, make_tables

from engram_store import TieredStore
from engram_store.errors import ConfigError
from engram_store.storage.policies import make_policy
from engram_store.storage.policies.s3fifo import GhostSet, Ring, S3FifoPolicy
from engram_store.storage.row_cache import EpochGuard, RowCache
from engram_store.tools.synth import synth_rows


def rows_bytes(rows: np.ndarray, rb: int = 8) -> np.ndarray:
    """Distinct bytes per row id for RowCache unit tests."""
    return (rows[:, None] * 7 + np.arange(rb)).astype(np.uint8)


def fill(cache: RowCache, layer: int, rows: np.ndarray) -> int:
    rows = np.unique(rows)
    return cache.admit(layer, rows, rows_bytes(rows, cache.row_bytes))


def guards() -> list:
    from engram_store.native import load

    native = load("_gather", "")
    return [EpochGuard] + ([native.EpochGuard] if native is not None else [])


@pytest.mark.parametrize("make_guard", guards(), ids=lambda g: g.__module__)
def test_epoch_guards_keep_the_same_books(make_guard):
    """The native EpochGuard (shared with the daemon's native readers) and the Python one agree step by step."""
    g = make_guard()
    with g:
        assert g.oldest() is None and g.enter() == 0 and g.enter() == 0 and g.readers == 2
        assert g.advance() == 0 and g.epoch == 1 and g.enter() == 1 and g.oldest() == 0
    g.leave(0)
    with g:
        assert g.oldest() == 0 and g.readers == 2
    g.leave(0)
    with g:
        assert g.oldest() == 1 and g.advance() == 1 and g.advance() == 2 and g.oldest() == 1
    g.leave(1)
    with g:
        assert g.oldest() is None and g.readers == 0 and g.epoch == 3


@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
def test_slot_is_not_reused_under_a_reader(policy):
    cache = RowCache({0: 10_000}, 8, 64, policy, huge=False)
    try:
        fill(cache, 0, np.arange(64))
        token, found = cache.begin(0, np.arange(64))
        slots = found[found > 0] - 1
        assert len(slots) == cache.used > 0
        before = cache.slots[slots].copy()
        for start in range(1000, 9000, 40):  # churn: every slot evicted many times over
            fill(cache, 0, np.arange(start, start + 40))
        np.testing.assert_array_equal(cache.slots[slots], before)  # the reader's slots were kept
        assert cache.not_admitted > 0
        cache.end(token)
        fill(cache, 0, np.arange(20_00, 20_64) % 10_000)
        assert cache.free_top + cache.limbo_slots + cache.used == cache.n_slots
        token, found = cache.begin(0, np.arange(10_000))
        hit = np.flatnonzero(found)
        np.testing.assert_array_equal(cache.slots[found[hit] - 1], rows_bytes(hit))  # map and bytes agree
        cache.end(token)
    finally:
        cache.close()


def test_multithreaded_churn_is_byte_exact(tmp_path):
    tables = make_tables(tmp_path, TINY)
    store = TieredStore.open(tables, dram_bytes=cache_budget(TINY, 0.03), queue_depth=8)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                layer = TINY.layers[rng.integers(0, 2)]
                n = store.rows(layer)
                hot = rng.integers(0, 200, size=150)  # shared hot set + private cold tail
                ids = np.concatenate([hot, rng.integers(0, n, size=150)])
                out = store.lookup(layer, ids)
                np.testing.assert_array_equal(out, synth_rows(TINY, SEED, layer, ids))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    with store:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s = store.stats()
    assert not errors, errors[0]
    assert s["cache_evicted_rows"] > 0 and s["rows_dram"] > 0 and s["rows_nvme"] > 0
    assert s["requests"] == 240


def test_ring_wraps_in_order():
    r = Ring(5)
    r.push(np.array([1, 2, 3], np.int32))
    r.pop(2)
    r.push(np.array([4, 5, 6, 7], np.int32))
    assert r.peek(10).tolist() == [3, 4, 5, 6, 7]
    with pytest.raises(OverflowError):
        r.push(np.array([8], np.int32))


def test_ghost_remembers_recent_keys_only():
    g = GhostSet(1000)
    g.add(np.arange(300, dtype=np.int64))
    assert g.contains(np.arange(300, dtype=np.int64)).mean() > 0.8
    assert not g.contains(np.arange(10_000, 10_300, dtype=np.int64)).any()
    g.add(np.arange(5000, 9000, dtype=np.int64))  # 4x capacity newer additions age the first ones out
    assert g.contains(np.arange(300, dtype=np.int64)).mean() < 0.05


def test_unknown_policy():
    with pytest.raises(ConfigError):
        make_policy("arc", 10)


def simulate(policy_name: str, trace: list[np.ndarray], n_slots: int) -> float:
    """Hit rate of a policy on request batches, through RowCache (the real code path)."""
    cache = RowCache({0: 1 << 20}, 8, n_slots, policy_name, huge=False)
    hits = total = 0
    try:
        for req in trace:
            req = np.unique(req)
            token, found = cache.begin(0, req)
            cache.end(token)
            hits += int(np.count_nonzero(found))
            total += len(req)
            miss = req[found == 0]
            cache.admit(0, miss, rows_bytes(miss))
    finally:
        cache.close()
    return hits / total


def zipf_scan_trace(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    universe = 200_000
    p = 1.0 / np.arange(1, universe + 1) ** 1.0
    p /= p.sum()
    perm = rng.permutation(universe)
    trace = []
    for i in range(300):
        trace.append(perm[rng.choice(universe, size=256, p=p)])
        if i % 10 == 5:  # a scan of never-seen-again rows
            trace.append(rng.integers(universe, 1 << 20, size=2048))
    return trace


def test_s3fifo_beats_lru_on_zipf_with_scans():
    trace = zipf_scan_trace(3)
    s3 = simulate("s3fifo", trace, 2000)
    lru = simulate("lru", trace, 2000)
    assert s3 > lru + 0.02, (s3, lru)


def test_s3fifo_evict_frees_what_was_asked():
    p = S3FifoPolicy(100)
    keys = np.arange(100, dtype=np.int64)
    p.insert(np.arange(100, dtype=np.int32), keys)
    p.on_hit(np.arange(0, 100, 2, dtype=np.int32))
    victims = p.evict(30, keys)
    assert len(victims) == 30 == len(np.unique(victims))
    assert p.tracked == 70
    rest = p.evict(1000, keys)
    assert len(rest) == 70 and p.tracked == 0
    assert set(victims.tolist()) | set(rest.tolist()) == set(range(100))
