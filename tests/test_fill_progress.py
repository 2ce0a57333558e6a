"""The daemon logs the resident fill's progress: the arena memfd's allocated bytes against the planned arena."""

from __future__ import annotations

import logging
import mmap
import os
import re

from engram_store.daemon.config import load_config
from engram_store.daemon.fill_progress import arena_bytes_filled, logged_fill, planned_arena_bytes
from engram_store.native.syscalls import create_memfd
from engram_store.models.spec import get_spec
from engram_store.storage.tiered import TieredStore
from engram_store.tools.synth import write_synthetic


def test_arena_bytes_filled_counts_written_pages():
    name = f"engram-arena-test-{os.getpid()}"
    assert arena_bytes_filled(name) == 0
    memfd = create_memfd(name, 8 << 20, huge=False)
    try:
        assert arena_bytes_filled(name) == 0  # sized, nothing written
        with mmap.mmap(memfd.fd, 8 << 20) as mm:
            mm[: 3 << 20] = b"\1" * (3 << 20)
            assert 3 << 20 <= arena_bytes_filled(name) < 4 << 20
    finally:
        memfd.close()
    assert arena_bytes_filled(name) == 0


def test_fill_of_a_real_store_is_logged(tmp_path, caplog):
    spec = get_spec("deepseek-v4.1-flash", 0.001)
    write_synthetic(tmp_path / "t", spec, seed=0)
    config = load_config({"tables": str(tmp_path / "t"), "dram_bytes": "1GiB", "store_mode": "resident",
                          "huge_pages": False}, environ={})
    total = planned_arena_bytes(config)
    assert total >= sum(spec.rows(layer) * spec.row_bytes for layer in spec.layers)
    log = logging.getLogger("engram_store.test_fill")
    with caplog.at_level(logging.INFO, logger=log.name):
        with logged_fill(config, log, every=0, interval=0.002):
            store = TieredStore.open(config.tables, dram_bytes=config.dram_bytes, mode="resident", huge_pages=False)
        store.close()
    lines = [r.getMessage() for r in caplog.records if r.name == log.name]
    shares = [float(re.match(r"resident fill: +([\d.]+)% ", line).group(1)) for line in lines]
    assert shares and shares == sorted(shares) and shares[-1] <= 100, lines
    assert all("GB, " in line and "MB/s" in line and "left" in line for line in lines)


def test_no_resident_layer_no_progress(tmp_path, caplog):
    write_synthetic(tmp_path / "t", get_spec("tiny"), seed=0)
    config = load_config({"tables": str(tmp_path / "t"), "store_mode": "cached", "dram_bytes": "1MiB"}, environ={})
    assert planned_arena_bytes(config) == 0
    with logged_fill(config, logging.getLogger("x"), every=0, interval=0.001):
        pass
    bad = load_config({"tables": str(tmp_path / "none")}, environ={})
    with logged_fill(bad, logging.getLogger("x")):  # the store's open names the problem, not the progress
        pass
