"""TieredStore: byte-exact in every mode, input validation, broken layers, arena sharing."""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.storage_helpers import FLASH, TINY, cache_budget, check_rows, make_tables

from engram_store import TieredStore
from engram_store.errors import ConfigError, InvalidRequest, RowOutOfRange, StorageError, UnknownLayer
from engram_store.storage.base import RowStore

MODES = {
    "resident": dict(dram_bytes=1 << 30),
    "cached-threads": dict(fraction=0.1, reader="threads", max_coalesce_pages=4),
    "cached-25": dict(fraction=0.25),
    "cached-5": dict(fraction=0.05),
    "cached-1slot": dict(dram_bytes=400),
}


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    root = tmp_path_factory.mktemp("tables")
    return {"tiny": make_tables(root, TINY), "flash": make_tables(root, FLASH)}


def open_store(tables, spec_name, mode, **kw):
    spec = TINY if spec_name == "tiny" else FLASH
    cfg = dict(MODES[mode])
    if "fraction" in cfg:
        cfg["dram_bytes"] = cache_budget(spec, cfg.pop("fraction"))
    return spec, TieredStore.open(tables[spec_name], **cfg, **kw)


@pytest.mark.parametrize("spec_name", ["tiny", "flash"])
@pytest.mark.parametrize("mode", list(MODES))
def test_byte_exact(tables, spec_name, mode):
    spec, store = open_store(tables, spec_name, mode)
    try:
        assert isinstance(store, RowStore)
        assert store.mode == ("resident" if mode == "resident" else "cached")
        rng = np.random.default_rng(5)
        for _ in range(6):
            for layer in store.layers:
                rows = store.rows(layer)
                hot = rng.integers(0, rows, size=64)
                ids = np.concatenate([rng.integers(0, rows, size=300), rng.choice(hot, size=300)])
                ids = ids.reshape(25, 24)
                out = np.full(ids.shape + (store.row_bytes,), 0xEE, dtype=np.uint8)
                st = store.lookup_into(layer, ids, out)
                check_rows(store, tables[spec_name], spec, layer, ids, out)
                assert st.rows == ids.size == st.rows_dram + st.rows_nvme
        s = store.stats()
        assert s["rows"] == s["rows_dram"] + s["rows_nvme"] == 6 * len(store.layers) * 600
        assert s["bytes_nvme"] == s["rows_nvme"] * store.row_bytes
        if mode != "resident":
            assert s["nvme_pages_read"] > 0 and s["rows_nvme"] > 0
            assert s["cache_slots_used"] <= s["cache_slots"]
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["resident", "cached-5"])
def test_odd_requests(tables, mode):
    spec, store = open_store(tables, "tiny", mode)
    with store:
        layer = store.layers[-1]
        last = store.rows(layer) - 1
        for ids in [
            np.zeros(0, dtype=np.int64),
            np.zeros((3, 0, 2), dtype=np.int64),
            np.array([last, last, 0, last], dtype=np.int64),
            np.array(7, dtype=np.int64),  # 0-d
            np.full(50, 3, dtype=np.int32),
            np.array([last, 1], dtype=np.uint16),
        ]:
            out = store.lookup(layer, ids)
            assert out.shape == ids.shape + (store.row_bytes,)
            check_rows(store, tables["tiny"], spec, layer, ids.astype(np.int64), out)
        st = store.lookup_into(layer, np.zeros(0, dtype=np.int64), np.zeros((0, store.row_bytes), np.uint8))
        assert st.rows == 0


@pytest.mark.parametrize("mode", ["resident", "cached-5"])
def test_bad_input_is_rejected_before_out_changes(tables, mode):
    _, store = open_store(tables, "tiny", mode)
    with store:
        layer = store.layers[0]
        rows, rb = store.rows(layer), store.row_bytes
        out = np.full((3, rb), 0xAB, dtype=np.uint8)
        cases = [
            (RowOutOfRange, layer, np.array([0, rows, 1])),
            (RowOutOfRange, layer, np.array([0, -1, 1])),
            (RowOutOfRange, layer, np.array([0, 1, 2**63 - 1], dtype=np.uint64)),
            (InvalidRequest, layer, np.array([0.0, 1.0, 2.0])),
            (InvalidRequest, layer, np.array([True, False, True])),
            (UnknownLayer, 99, np.array([0, 1, 2])),
            (UnknownLayer, "1", np.array([0, 1, 2])),
        ]
        for exc, lay, ids in cases:
            with pytest.raises(exc):
                store.lookup_into(lay, ids, out)
            assert (out == 0xAB).all()
        ids = np.array([0, 1, 2])
        for bad in [np.zeros((3, rb + 1), np.uint8), np.zeros((3, rb), np.int8), np.zeros((4, rb), np.uint8),
                    np.zeros((rb, 3), np.uint8).T, np.zeros((3, rb), np.uint8).tolist()]:
            with pytest.raises(InvalidRequest):
                store.lookup_into(layer, ids, bad)
        ro = np.zeros((3, rb), np.uint8)
        ro.setflags(write=False)
        with pytest.raises(InvalidRequest):
            store.lookup_into(layer, ids, ro)
        assert store.stats()["requests"] == 0


@pytest.mark.parametrize("mode", ["resident", "cached-25"])
def test_truncated_layer_fails_alone(tmp_path, mode):
    reference = make_tables(tmp_path / "ref", TINY)
    tables = Path(shutil.copytree(reference, tmp_path / "broken"))
    bad_layer, good_layer = TINY.layers
    path = tables / f"layer_{bad_layer:03d}.bin"
    os.truncate(path, os.path.getsize(path) - 4096)
    store = TieredStore.open(tables, dram_bytes=1 << 30 if mode == "resident" else cache_budget(TINY, 0.25))
    with store:
        with pytest.raises(StorageError, match="truncated"):
            store.lookup(bad_layer, np.array([0, 1]))
        assert bad_layer in store.layer_errors()
        ids = np.arange(store.rows(good_layer))
        check_rows(store, reference, TINY, good_layer, ids, store.lookup(good_layer, ids))
        assert store.stats()["layers_unavailable"] == 1


def test_file_truncated_after_open_gives_storage_error(tmp_path):
    reference = make_tables(tmp_path / "ref", TINY)
    tables = Path(shutil.copytree(reference, tmp_path / "broken"))
    store = TieredStore.open(tables, dram_bytes=cache_budget(TINY, 0.05))
    with store:
        layer = store.layers[0]
        os.truncate(tables / f"layer_{layer:03d}.bin", 8192)
        with pytest.raises(StorageError):
            store.lookup(layer, np.array([store.rows(layer) - 1]))
        other = store.layers[1]
        check_rows(store, reference, TINY, other, np.array([5, 6]), store.lookup(other, np.array([5, 6])))


def test_resident_arena_is_sealed_and_shareable(tables):
    _, store = open_store(tables, "flash", "resident")
    with store:
        info = store.arena()
        assert info is not None and info.size % 4096 == 0
        with pytest.raises(PermissionError):
            mmap.mmap(info.fd, info.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mm = mmap.mmap(info.fd, info.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        data = np.frombuffer(mm, dtype=np.uint8)
        fmt = FLASH.row_format
        ends = []
        for a in info.layers:  # the engines' layout: a weights block and a scales block, each 2 MiB aligned
            assert a.weight_offset % (2 << 20) == 0 and a.scale_offset % (2 << 20) == 0
            assert (a.weight_bytes, a.scale_bytes) == (fmt.dim, fmt.scale_count) and a.rows == store.rows(a.layer)
            assert a.scale_offset >= a.weight_offset + a.rows * a.weight_bytes
            ends.append((a.weight_offset, a.scale_offset + a.rows * a.scale_bytes))
            ids = np.array([0, 17, a.rows - 1])
            weights = data[a.weight_offset + ids[:, None] * a.weight_bytes + np.arange(a.weight_bytes)]
            scales = data[a.scale_offset + ids[:, None] * a.scale_bytes + np.arange(a.scale_bytes)]
            mine = np.concatenate([weights, scales], axis=1)
            check_rows(store, tables["flash"], FLASH, a.layer, ids, mine)
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(ends, ends[1:])) and ends[-1][1] <= info.size  # no overlap
        del data, mine
        mm.close()


def test_cached_mode_has_no_arena_and_config_errors(tables):
    _, store = open_store(tables, "tiny", "cached-5")
    with store:
        assert store.arena() is None
    for bad in [dict(dram_bytes=1 << 30, mode="bogus"), dict(dram_bytes=1 << 30, policy="fifo"),
                dict(dram_bytes=-1), dict(dram_bytes=10), dict(dram_bytes=1000, mode="resident"),
                dict(dram_bytes=1 << 30, queue_depth=0), dict(dram_bytes=1 << 30, queue_depth=257),
                dict(dram_bytes=1 << 30, max_coalesce_pages=0), dict(dram_bytes=1 << 30, reader="bogus"),
                dict(dram_bytes=1 << 30, gds="sometimes")]:
        with pytest.raises(ConfigError):
            TieredStore.open(tables["tiny"], **bad)


def test_forced_cached_mode_and_policies(tables):
    for policy in ["s3fifo", "lru"]:
        store = TieredStore.open(tables["tiny"], dram_bytes=1 << 30, mode="cached", policy=policy, reader="threads")
        with store:
            assert store.mode == "cached"
            ids = np.arange(0, store.rows(1), 3)
            for _ in range(2):
                check_rows(store, tables["tiny"], TINY, 1, ids, store.lookup(1, ids))
            assert store.stats()["rows_dram"] > 0  # the second pass hits


def test_closed_store_refuses(tables):
    _, store = open_store(tables, "tiny", "resident")
    store.close()
    store.close()
    with pytest.raises(StorageError):
        store.lookup(1, np.array([0]))


def test_memory_beyond_dram_is_small(tables):
    _, store = open_store(tables, "flash", "cached-25")
    with store:
        rng = np.random.default_rng(1)
        for _ in range(5):
            store.lookup(14, rng.integers(0, store.rows(14), size=2000))
        mem = store.memory()
        assert mem["row_map_bytes"] == 4 * sum(store.rows(x) for x in store.layers)
        # staging is a fixed few MiB (queue depth x coalesced read), the rest scales with the table
        assert 0 < mem["staging_bytes"] <= 4 * 64 * 16 * 4096
        assert (mem["beyond_dram_bytes"] - mem["staging_bytes"]) / mem["table_bytes"] < 0.05
