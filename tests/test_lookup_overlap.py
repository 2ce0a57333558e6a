"""A cached layer's lookup with hits and misses: a helper thread copies its hits while it reads its misses
(storage/overlap.py), and ``lookup_into_deferred`` leaves the cache's admission of the rows read to the
caller. Bytes against both references; admission counted only once the caller runs it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support.storage_helpers import FLASH, cache_budget, check_rows, make_tables

from engram_store.storage.cached_path import OVERLAP_MIN_HITS
from engram_store.storage.overlap import ReadOverlap
from engram_store.storage.tiered import TieredStore

LAYER = FLASH.layers[-1]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("overlap"), FLASH)


def open_store(tables, **kw):
    return TieredStore.open(tables, dram_bytes=cache_budget(FLASH, 0.2), mode="cached", **kw)


def hits_and_misses(store, rng, n_hit: int, n_miss: int) -> np.ndarray:
    """ids with ``n_hit`` rows cached (looked up first) and ``n_miss`` rows that are not, shuffled, with repeats."""
    rows = FLASH.rows(LAYER)
    warm = rng.choice(rows, n_hit, replace=False)
    out = np.empty((n_hit, FLASH.row_bytes), np.uint8)
    store.lookup_into(LAYER, warm, out)
    cold = np.setdiff1d(rng.choice(rows, 4 * n_miss, replace=False), warm)[:n_miss]
    ids = np.concatenate([warm, cold, cold[: n_miss // 4]])  # some misses twice
    return rng.permutation(ids)


def test_hits_are_copied_during_the_reads_and_rows_are_exact(tables):
    rng = np.random.default_rng(1)
    with open_store(tables) as store:
        ids = hits_and_misses(store, rng, 2 * OVERLAP_MIN_HITS, 700)
        before = store.parts.overlap.started
        out = np.empty((len(ids), FLASH.row_bytes), np.uint8)
        st = store.lookup_into(LAYER, ids, out)
        assert store.parts.overlap.started == before + 1  # the hits were copied on a helper
        assert store.parts.cache.lock.readers == 0  # and it ended the lookup's cache read
        assert st.rows_dram == 2 * OVERLAP_MIN_HITS and st.rows_nvme == len(ids) - st.rows_dram
        check_rows(store, tables, FLASH, LAYER, ids, out)


def test_few_hits_are_copied_on_the_calling_thread(tables):
    rng = np.random.default_rng(2)
    with open_store(tables) as store:
        ids = hits_and_misses(store, rng, OVERLAP_MIN_HITS // 4, 300)
        before = store.parts.overlap.started
        out = np.empty((len(ids), FLASH.row_bytes), np.uint8)
        store.lookup_into(LAYER, ids, out)
        assert store.parts.overlap.started == before
        check_rows(store, tables, FLASH, LAYER, ids, out)


def test_busy_helpers_leave_the_work_to_the_caller(tables):
    overlap = ReadOverlap(1)
    release, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        release.wait(10)

    try:
        first = overlap.start(hold)
        assert first is not None and started.wait(10)
        assert overlap.start(lambda: None) is None  # never queued behind another lookup's work
        release.set()
        first.result(10)
        assert overlap.start(lambda: 7).result(10) == 7
    finally:
        release.set()
        overlap.close()
    assert overlap.start(lambda: None) is None  # closed


def test_deferred_admission_runs_when_the_caller_says(tables):
    rng = np.random.default_rng(3)
    with open_store(tables) as store:
        ids = hits_and_misses(store, rng, 2 * OVERLAP_MIN_HITS, 500)
        admitted = store.stats()["cache_admitted_rows"]
        out = np.empty((len(ids), FLASH.row_bytes), np.uint8)
        st, admit = store.lookup_into_deferred(LAYER, ids, out)
        check_rows(store, tables, FLASH, LAYER, ids, out)
        assert admit is not None and st.nvme_rows_distinct == 500
        assert store.stats()["cache_admitted_rows"] == admitted  # nothing admitted yet
        again = store.lookup_into(LAYER, ids, np.empty_like(out))
        assert again.rows_nvme > 0  # the misses are still misses
        admit()
        assert store.stats()["cache_admitted_rows"] > admitted
        st3, admit3 = store.lookup_into_deferred(LAYER, ids, out)
        assert st3.rows_nvme == 0 and admit3 is None  # every row in DRAM now: nothing to admit
        check_rows(store, tables, FLASH, LAYER, ids, out)


def test_deferred_admission_after_close_does_nothing(tables):
    rng = np.random.default_rng(4)
    store = open_store(tables)
    ids = rng.choice(FLASH.rows(LAYER), 300, replace=False)
    _, admit = store.lookup_into_deferred(LAYER, ids, np.empty((300, FLASH.row_bytes), np.uint8))
    store.close()
    admit()  # the store is closed: no error, nothing admitted
