"""``TieredStore.close()`` while lookups run: it waits for the ones in flight, later ones fail clearly.

Before, a lookup racing ``close()`` failed with EBADF or a raw IndexError, and with the
native reader a file descriptor number reused by another open could have been read.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engram_store import errors
from engram_store.models.spec import get_spec
from engram_store.storage.tiered import TieredStore
from engram_store.tools.synth import synth_rows, write_synthetic

SPEC = get_spec("tiny")
SEED = 9
THREADS = 4
WARM_LOOKUPS = 3  # lookups each thread completes before close() is called
MAX_LOOKUPS = 200  # bound on each thread's loop
ROWS = 20000  # per lookup: long enough (NVMe pages, or a large gather) that close() lands inside one


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    path = tmp_path_factory.mktemp("close") / "tiny"
    write_synthetic(path, SPEC, seed=SEED)
    return path


@pytest.mark.parametrize("mode", ["cached", "resident"])
def test_close_during_lookups_gives_exact_rows_or_a_clear_error(tables, mode):
    store = TieredStore.open(tables, dram_bytes=(1 << 20) if mode == "cached" else (1 << 30), mode=mode)
    layer = SPEC.layers[0]
    progress = threading.Condition()
    done = [0] * THREADS
    results: list[list] = [[] for _ in range(THREADS)]  # (ids, rows) per lookup, checked after the threads end
    endings: list[str] = [""] * THREADS

    def worker(k: int) -> None:
        # Lookups back to back (nothing between them but drawing ids), so close() finds them in flight.
        rng = np.random.default_rng(k)
        for _ in range(MAX_LOOKUPS):
            ids = rng.integers(0, SPEC.rows(layer), ROWS)
            try:
                results[k].append((ids, store.lookup(layer, ids)))
            except errors.StorageError as exc:
                endings[k] = "closed" if str(exc) == "the store is closed" else f"unclear: {exc!r}"
                return
            except Exception as exc:  # anything else is the bug this test is about
                endings[k] = f"raw: {exc!r}"
                return
            with progress:
                done[k] += 1
                progress.notify_all()
        endings[k] = "never closed"

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    with progress:
        assert progress.wait_for(lambda: min(done) >= WARM_LOOKUPS or not all(t.is_alive() for t in threads), 60)
    store.close()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert endings == ["closed"] * THREADS, endings  # every thread ended on the clear error, nothing else
    for k in range(THREADS):
        assert len(results[k]) >= WARM_LOOKUPS
        for ids, rows in results[k]:  # every lookup that returned rows returned the right ones
            np.testing.assert_array_equal(rows, synth_rows(SPEC, SEED, layer, ids))
    with pytest.raises(errors.StorageError, match="the store is closed"):
        store.lookup(layer, np.arange(3))
