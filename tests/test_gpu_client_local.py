"""LocalClient / MemoryTables (the in-process baseline) and the resident arena gather on CPU."""

from __future__ import annotations

import fcntl
import mmap
import subprocess
import sys

import numpy as np
import pytest
import torch

from engram_store import TieredStore, get_spec
from engram_store.errors import InvalidRequest, RowOutOfRange, UnknownLayer
from engram_store.storage.base import RowStore
from gpu_client import ArenaGather, LocalClient, MemoryTables

SPEC = get_spec("tiny")


@pytest.fixture(scope="module")
def tables(tiny_tables):
    return tiny_tables(seed=11)


def test_import_does_not_load_torch():
    code = "import sys, gpu_client; gpu_client.LocalClient; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_memory_tables_is_a_row_store(client):
    assert isinstance(client.store, RowStore)


def test_lookup_matches_reference(client, tables):
    ts = tables[1]
    rng = np.random.default_rng(0)
    for layer in SPEC.layers:
        ids = rng.integers(0, SPEC.rows(layer), size=(50, SPEC.rows_per_token))
        ids[0, :3] = [0, SPEC.rows(layer) - 1, 0]  # both ends, and a duplicate
        want = ts.read_rows(layer, ids).reshape(ids.shape + (SPEC.row_bytes,))
        np.testing.assert_array_equal(client.lookup(layer, ids), want)
        out = np.zeros_like(want)
        client.lookup_into(layer, ids.astype(np.int32), out)
        np.testing.assert_array_equal(out, want)


def test_info_and_stats(client):
    info = client.info()
    assert info["layers"] == list(SPEC.layers)
    assert info["rows"] == {layer: SPEC.rows(layer) for layer in SPEC.layers}
    assert info["row_bytes"] == SPEC.row_bytes and info["mode"] == "resident"
    assert info["spec"] == SPEC.to_dict()
    before = client.stats()["rows_dram"]
    client.lookup(SPEC.layers[0], np.arange(7))
    assert client.stats()["rows_dram"] == before + 7


def test_bad_lookups_leave_out_untouched(client):
    layer = SPEC.layers[0]
    out = np.full((2, SPEC.row_bytes), 9, dtype=np.uint8)
    with pytest.raises(UnknownLayer):
        client.lookup_into(99, np.array([0, 1]), out)
    with pytest.raises(RowOutOfRange):
        client.lookup_into(layer, np.array([0, SPEC.rows(layer)]), out)
    with pytest.raises(RowOutOfRange):
        client.lookup_into(layer, np.array([-1, 0]), out)
    with pytest.raises(InvalidRequest):
        client.lookup_into(layer, np.array([0.5, 1.0]), out)
    with pytest.raises(InvalidRequest):
        client.lookup_into(layer, np.array([0, 1, 2]), out)
    assert (out == 9).all()


def test_arena_is_sealed_read_only(client):
    arena = client.store.arena()
    seals = fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_WRITE
    with pytest.raises(PermissionError):
        mmap.mmap(arena.fd, arena.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    assert all(e.weight_offset % (2 << 20) == 0 and e.scale_offset % (2 << 20) == 0 for e in arena.layers)


def test_arena_gather_matches_reference(client, tables):
    gather = ArenaGather.for_client(client, SPEC, torch.device("cpu"))
    assert gather is not None and gather.path == "resident-cpu"
    try:
        for layer in SPEC.layers:
            ids = np.random.default_rng(layer).integers(0, SPEC.rows(layer), size=300)
            out = torch.empty(300, SPEC.row_bytes, dtype=torch.uint8)
            gather.gather_into(layer, torch.from_numpy(ids), out)
            np.testing.assert_array_equal(out.numpy(), tables[1].read_rows(layer, ids))
    finally:
        gather.close()


def test_arena_of_another_spec_is_refused(client):
    other = SPEC.scaled(0.5)
    assert ArenaGather.for_client(client, other, torch.device("cpu")) is None
    with pytest.raises(InvalidRequest):
        ArenaGather(client.arena, other, torch.device("cpu"))


def test_store_arena_fd_is_mapped(client, tables):
    """A RowStore-style ``arena()`` (an ArenaInfo with an fd) works as well as a client's mapped arena."""
    gather = ArenaGather.for_client(client.store, SPEC, torch.device("cpu"))
    ids = torch.arange(SPEC.rows(SPEC.layers[1]) - 20, SPEC.rows(SPEC.layers[1]))
    out = torch.empty(20, SPEC.row_bytes, dtype=torch.uint8)
    gather.gather_into(SPEC.layers[1], ids, out)
    np.testing.assert_array_equal(out.numpy(), tables[1].read_rows(SPEC.layers[1], ids.numpy()))
    gather.close()


def test_client_without_arena_has_no_fast_path():
    class Remote:
        @property
        def arena(self):
            raise ConnectionError("no fd passing over gRPC")

    assert ArenaGather.for_client(Remote(), SPEC, torch.device("cpu")) is None
    assert ArenaGather.for_client(object(), SPEC, torch.device("cpu")) is None


def test_local_client_needs_a_spec(tables):
    store = MemoryTables.load(tables[0])
    try:
        with pytest.raises(InvalidRequest):
            LocalClient(type("Bare", (), {})())
        assert LocalClient(store).spec == SPEC
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["resident", "cached"])
def test_local_client_over_the_tiered_store(tables, mode):
    with LocalClient(TieredStore.open(tables[0], dram_bytes=16 << 20, mode=mode)) as client:
        assert client.info()["mode"] == mode and client.spec == SPEC
        layer = SPEC.layers[1]
        ids = np.random.default_rng(5).integers(0, SPEC.rows(layer), size=(64, SPEC.rows_per_token))
        want = tables[1].read_rows(layer, ids).reshape(ids.shape + (SPEC.row_bytes,))
        np.testing.assert_array_equal(client.lookup(layer, ids), want)
        assert (client.arena is not None) == (mode == "resident")
