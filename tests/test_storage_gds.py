"""kvikio / GPUDirect Storage bulk reader: optional, probed once, logged."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from support.storage_helpers import FLASH, check_rows, make_tables

from engram_store import TieredStore
from engram_store.errors import ConfigError
from engram_store.native.readers import open_reader
from engram_store.storage.gds import make_bulk_reader, probe_kvikio


def test_posix_reader_is_used_and_logged_without_kvikio(caplog):
    probe = probe_kvikio()
    if probe.available:
        pytest.skip("kvikio and CUDA are present: the fallback path is not taken here")
    with caplog.at_level(logging.INFO, logger="engram_store.storage.gds"):
        _, name = make_bulk_reader(open_reader(4), "auto")
    assert name == "posix" and "POSIX" in caplog.text and probe.reason in caplog.text
    with pytest.raises(ConfigError, match="gds=on"):
        make_bulk_reader(open_reader(4), "on")
    with pytest.raises(ConfigError):
        make_bulk_reader(open_reader(4), "maybe")


def test_resident_fill_through_kvikio(tmp_path):
    probe = probe_kvikio()
    if not probe.available:
        pytest.skip(f"needs kvikio and a CUDA device: {probe.reason}")
    tables = make_tables(tmp_path, FLASH)
    with TieredStore.open(tables, dram_bytes=1 << 30, gds="on") as store:
        assert store.bulk_reader in ("kvikio-cufile", "kvikio-compat")
        ids = np.arange(0, store.rows(14), 97)
        check_rows(store, tables, FLASH, 14, ids, store.lookup(14, ids))
