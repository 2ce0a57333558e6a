"""EngramStoreTables, the engines' view of a daemon's arena: zero-copy tensors at the layout's
offsets, byte-exact against the reference reader, read-only, refused where it cannot work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.daemon_helpers import DaemonProcess, make_tables

from engram_store import errors
from engram_store.integrations.tables import EngramStoreTables


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=13)


@pytest.fixture(scope="module")
def resident(tables, tmp_path_factory):
    with DaemonProcess(tables.directory, tmp_path_factory.mktemp("resident")) as d:
        yield d


def test_views_are_the_arena_rows_of_a_range(resident, tables):
    t = EngramStoreTables.connect(resident.unix)
    fmt = t.spec.row_format
    assert t.layers == tables.layers and t.huge_pages in ("none", "thp", "hugetlb")
    base = t.view.array.ctypes.data
    for layer in tables.layers:
        rows = tables.rows(layer)
        for lo, hi in ((0, rows), (rows // 3, rows // 3 * 2), (rows - 1, rows), (5, 5)):
            weight, scales = t.views(layer, lo, hi)
            assert weight.dtype == torch.float8_e4m3fn and weight.shape == (hi - lo, fmt.dim)
            assert scales.dtype == torch.uint8 and scales.shape == (hi - lo, fmt.scale_count)
            assert weight.is_contiguous() and scales.is_contiguous()
            a = t.view.layout.layer(layer)
            if hi > lo:  # an empty tensor has no address
                assert weight.data_ptr() == base + a.weight_offset + lo * fmt.dim  # zero copy, at the layout's offset
                assert scales.data_ptr() == base + a.scale_offset + lo * fmt.scale_count
            want = tables.read_rows(layer, np.arange(lo, hi))
            got = np.concatenate([weight.view(torch.uint8).numpy(), scales.numpy()], axis=1)
            np.testing.assert_array_equal(got, want)
        with pytest.raises(errors.UnknownLayer):
            t.views(layer, 0, rows + 1)
    with pytest.raises(errors.UnknownLayer):
        t.views(2)
    with pytest.raises(ValueError):  # the mapping is read-only: a write through numpy is refused
        t.view.array[0] = 1


def test_model_check_names_the_field_and_both_values(resident, tables):
    t = EngramStoreTables.connect(resident.unix)
    spec = t.spec
    good = dict(layer_ids=spec.layers, rows=[spec.rows(layer) for layer in spec.layers],
                head_sizes=[spec.primes(layer).reshape(-1) for layer in spec.layers],
                dim=spec.row_format.dim, scale_block=spec.row_format.scale_block)
    t.check_model(**good)
    for field, value, named in (("layer_ids", (1, 4), "layer ids"), ("dim", 128, "head dim"),
                                ("scale_block", 16, "scale block"),
                                ("rows", [spec.rows(1), spec.rows(3) - 1], "rows of Engram layer 3")):
        with pytest.raises(errors.ModelMismatch, match=named) as exc:
            t.check_model(**(good | {field: value}))
        assert str(value if not isinstance(value, list) else value[-1]) in str(exc.value)
    sizes = [list(s) for s in good["head_sizes"]]
    sizes[0][0] += 2
    with pytest.raises(errors.ModelMismatch, match="hash head sizes of Engram layer 1"):
        t.check_model(**(good | {"head_sizes": sizes}))


def test_cached_daemon_is_served_through_fetch_jobs_and_grpc_is_refused(tables, tmp_path):
    with DaemonProcess(tables.directory, tmp_path, dram_bytes="256KiB") as d:
        t = EngramStoreTables.connect(d.unix)
        assert t.view is None and t.placement == {1: "cached", 3: "cached"} and not t.is_resident(3)
        with pytest.raises(errors.StorageError, match="layer 3 is cached"):
            t.views(3)
        ids = np.random.default_rng(4).integers(-1, tables.rows(3), 500)  # -1: padding, zero rows
        weight, scales = t.staged(3, ids)
        want = np.where((ids >= 0)[:, None], tables.read_rows(3, np.clip(ids, 0, None)), 0)
        np.testing.assert_array_equal(np.concatenate([weight.view(torch.uint8).numpy(), scales.numpy()], 1), want)
        t.check_fetches()
        with pytest.raises(errors.ConfigError, match="Unix socket"):
            EngramStoreTables.connect(d.grpc)
    with pytest.raises(errors.Unavailable):
        EngramStoreTables.connect(f"unix://{tmp_path}/nobody.sock", connect_timeout=0.5)


def test_mapping_outlives_the_daemon(tables, tmp_path):
    """An engine's views stay valid when the daemon goes away (its memfd lives in the mapping)."""
    d = DaemonProcess(tables.directory, tmp_path)
    try:
        d.start()
        t = EngramStoreTables.connect(d.unix)
        weight, scales = t.views(3)
        d.kill()
        want = tables.read_rows(3, np.arange(tables.rows(3)))
        np.testing.assert_array_equal(np.concatenate([weight.view(torch.uint8).numpy(), scales.numpy()], 1), want)
    finally:
        d.stop()


def test_an_arena_with_corrupt_pages_is_not_read_in_place(tmp_path):
    """Rows of a page failing its checksum are zeros in the arena: engines must not map it,
    the prefetcher must not gather from it (lookups through the daemon refuse those rows)."""
    from engram_store.format.manifest import Manifest
    from gpu_client import ArenaGather, EngramClient

    ts = make_tables(tmp_path / "t", seed=14)
    layer = ts.layers[0]
    path = tmp_path / "t" / Manifest.load(tmp_path / "t").layer(layer).file
    with open(path, "r+b") as f:  # one byte inside page 3's first row
        f.seek(3 * 4096 + 10)
        b = f.read(1)
        f.seek(3 * 4096 + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    (tmp_path / "run").mkdir()
    with DaemonProcess(tmp_path / "t", tmp_path / "run") as d:
        with pytest.raises(errors.StorageError, match=rf"layer {layer} pages \[3, 4\).*repair the table set"):
            EngramStoreTables.connect(d.unix)
        with EngramClient.connect(d.grpc, token_file=d.token_file) as remote:  # remote clients are told too
            assert remote.info()["bad_pages"] == {str(layer): [[3, 4]]}
        with EngramClient.connect(d.unix) as client:
            assert client.info()["bad_pages"] == {str(layer): [[3, 4]]}
            assert client.arena is not None  # the daemon still offers it; the gather declines it
            assert ArenaGather.for_client(client, ts.spec, torch.device("cpu")) is None
            with pytest.raises(errors.StorageError, match="page 3"):
                client.lookup(layer, np.array([3 * (4096 // ts.row_bytes)]))


def test_an_engine_made_on_one_table_set_never_serves_another_after_a_restart(tables, tmp_path, caplog):
    """Connect on table set A, restart the daemon on B (same spec, other rows) at the same socket: the
    staged job (grown) and a new fetch job keep A's rows (their own files, read directly), refusing B
    naming both; a client made on B gets B's rows."""
    other = make_tables(tmp_path / "B", seed=99)
    ids = np.random.default_rng(5).integers(0, tables.rows(3), 300)
    more = np.random.default_rng(6).integers(0, tables.rows(3), 5000)  # more than the staged job holds: it grows
    assert not np.array_equal(other.read_rows(3, more), tables.read_rows(3, more))  # B's rows differ from A's

    def exact(weight, scales, want_ids, ts=tables):
        got = np.concatenate([weight.view(torch.uint8).numpy(), scales.numpy()], 1)
        np.testing.assert_array_equal(got, ts.read_rows(3, want_ids))

    d = DaemonProcess(tables.directory, tmp_path, dram_bytes="256KiB")
    try:
        d.start()
        t = EngramStoreTables.connect(d.unix)
        exact(*t.staged(3, ids), ids)
        d.stop()
        d.tables = other.directory  # same workdir, same socket
        d.start()
        caplog.set_level("ERROR", logger="engram_store.fetch.job")
        exact(*t.staged(3, more), more)  # a grown job: A's rows, not B's
        job = t.fetch_job(3, 2048)
        job.ids[:2000] = more[:2000]
        job.run(2000)
        t.check_fetches()
        np.testing.assert_array_equal(np.concatenate([job.weight[:2000], job.scales[:2000]], 1),
                                      tables.read_rows(3, more[:2000]))
        assert not job.connected and job.stats()["daemon_steps"] == 0 and job.stats()["direct_steps"] == 1
        refusal = " ".join(r.getMessage() for r in caplog.records)
        assert f"{tables.directory}/layer_003" in refusal and f"{other.directory}/layer_003" in refusal, refusal
        t2 = EngramStoreTables.connect(d.unix)  # an engine started after the restart: B, from the daemon
        exact(*t2.staged(3, more), more, other)
        assert t2._staged[3].connected  # it took B's daemon
    finally:
        d.stop()
