"""The native NVMe reader after fork(): a child's reads are exact.

The parent's Linux-AIO contexts do not survive fork() (their ring is not copied into
the child), so a child that took one from ``_pread``'s pool failed every read with
EINVAL and put the bad context back for the next read.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.storage_helpers import make_tables

from engram_store.format.tableset import TableSet
from engram_store.native.readers.aio import native_reader
from engram_store.storage.tiered import TieredStore

pytestmark = pytest.mark.skipif(native_reader() is None, reason="native reader _pread not built")


def _nvme_reads_are_exact(store: TieredStore, tables: TableSet, seed: int) -> bool:
    rng = np.random.default_rng(seed)
    for _ in range(3):  # more than one read: a context returned to the pool is taken again
        layer = int(rng.choice(list(tables.layers)))
        ids = rng.integers(0, tables.rows(layer), 300)
        out = np.empty((ids.size, tables.row_bytes), np.uint8)
        store.lookup_into(layer, ids, out)
        if not np.array_equal(out, tables.read_rows(layer, ids)):
            return False
    return True


def test_nvme_reads_in_a_forked_child_are_exact(tmp_path):
    directory = make_tables(tmp_path)
    tables = TableSet.open(directory)
    store = TieredStore.open(directory, dram_bytes=400, mode="cached")  # one slot: every read goes to NVMe
    try:
        before = store.stats()["rows_nvme"]
        assert _nvme_reads_are_exact(store, tables, seed=1)  # the parent's AIO contexts are now pooled
        assert store.stats()["rows_nvme"] > before
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only, never return into pytest
            code = 1
            try:
                code = 0 if _nvme_reads_are_exact(store, tables, seed=2) else 3
            except BaseException:
                code = 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "child: 2 = read raised (EINVAL), 3 = wrong bytes"
        assert _nvme_reads_are_exact(store, tables, seed=3)  # the parent's pool is untouched
    finally:
        store.close()
        tables.close()
