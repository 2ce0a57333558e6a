"""Integrity on every read: a crc32c per 4 KiB page, checked wherever a page is read.

Bytes are flipped in real layer files (read back with O_DIRECT); the rows of the
flipped page must fail with a typed error naming layer and page, every other row
must stay exact (against the reference reader and the synthetic-row function),
and the counters must say so: in the store (cached and resident), in the resident
fill, in the scrub, and through real daemons over both transports.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected
from support.storage_helpers import flip

from engram_store import errors
from engram_store.format import checksums
from engram_store.format.layout import PAGE_BYTES
from engram_store.format.manifest import MANIFEST, Manifest
from engram_store.format.tableset import TableSet
from engram_store.native.readers.aio import native_reader
from engram_store.models.spec import get_spec
from engram_store.storage.resident import fill_split
from engram_store.storage.tiered import TieredStore
from engram_store.tools.synth import synth_rows, write_synthetic

SPEC = get_spec("tiny")
SEED = 5
LAYER = SPEC.layers[0]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("integrity") / "tiny"
    write_synthetic(path, SPEC, seed=SEED)
    return path


@pytest.fixture
def tables(pristine, tmp_path):
    """A private copy of the table set, free to corrupt."""
    copy = tmp_path / "tables"
    shutil.copytree(pristine, copy)
    return copy


def rows_of(page: int) -> np.ndarray:
    rpp = PAGE_BYTES // SPEC.row_bytes
    return np.arange(page * rpp, (page + 1) * rpp, dtype=np.int64)


def truth(layer: int, ids) -> np.ndarray:
    return synth_rows(SPEC, SEED, layer, np.asarray(ids))


# --- the checksum itself ------------------------------------------------------------------
def test_crc32c_native_and_software_match_the_reference():
    assert checksums.crc32c(b"123456789") == 0xE3069283  # the standard check value
    pages = np.random.default_rng(0).integers(0, 256, (9, PAGE_BYTES), dtype=np.uint8)
    want = checksums.page_crcs_numpy(pages)
    np.testing.assert_array_equal(checksums.page_crcs(pages), want)
    native = native_reader()
    if native is not None:  # both native code paths, whatever this CPU picks by default
        for software in (False, True):
            out = np.empty(9, dtype=np.uint32)
            native.page_crcs(pages, out, software)
            np.testing.assert_array_equal(out, want)
            assert native.crc32c(pages[3].tobytes()[5:], native.crc32c(pages[3].tobytes()[:5], 0, software),
                                 software) == want[3]


def test_synth_writes_one_crc_per_page(pristine):
    ts = TableSet.open(pristine)
    for e in ts.manifest.layers:
        data = np.fromfile(pristine / e.file, dtype=np.uint8).reshape(-1, PAGE_BYTES)
        np.testing.assert_array_equal(ts.page_crcs(e.layer), checksums.page_crcs_numpy(data))


def test_a_version_1_table_set_is_refused_with_what_to_do(tables):
    raw = json.loads((tables / MANIFEST).read_text())
    raw["version"] = 1
    (tables / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(errors.TableFormatError, match="re-synth or re-import"):
        Manifest.load(tables)


def test_verify_names_every_bad_page(tables):
    flip(tables, LAYER, 3)
    flip(tables, LAYER, 40, at=7)
    bad = TableSet.open(tables).verify()
    assert [(c.layer, c.page, c.offset) for c in bad] == [(LAYER, 3, 3 * PAGE_BYTES), (LAYER, 40, 40 * PAGE_BYTES)]


# --- the store --------------------------------------------------------------------------
@pytest.mark.parametrize("reader", ["native", "threads"])
def test_cached_lookups_refuse_rows_of_a_page_flipped_while_open(tables, reader):
    if reader == "native" and native_reader() is None:
        pytest.skip("native reader _pread not built")
    ref = TableSet.open(tables)
    with TieredStore.open(tables, dram_bytes=1 << 20, mode="cached", reader=reader) as store:
        good = np.arange(0, 200, dtype=np.int64)
        np.testing.assert_array_equal(store.lookup(LAYER, good), truth(LAYER, good))
        flip(tables, LAYER, 20)  # while the store serves; page 20 was never read nor cached
        bad_rows = rows_of(20)[[1, 5]]
        for _ in range(2):  # refused again: the page never entered the cache
            with pytest.raises(errors.CorruptRows, match=f"layer {LAYER}: .*page 20 at file offset {20 * PAGE_BYTES}"):
                store.lookup(LAYER, np.concatenate([good[:10], bad_rows]))
        others = np.setdiff1d(np.arange(0, SPEC.rows(LAYER), 97), rows_of(20))
        np.testing.assert_array_equal(store.lookup(LAYER, others), ref.read_rows(LAYER, others))
        np.testing.assert_array_equal(store.lookup(LAYER, others), truth(LAYER, others))
        st = store.stats()
        assert st["corrupt_pages"] == 1 and st["corrupt_rows_refused"] == 4 and st["request_errors"] == 2
        assert store.bad_pages() == {LAYER: [[20, 21]]}


def test_resident_fill_refuses_a_corrupt_page_and_serves_the_rest(tables):
    flip(tables, LAYER, 7)
    ref = TableSet.open(tables)
    with TieredStore.open(tables, dram_bytes=1 << 30, mode="resident") as store:
        assert store.bad_pages() == {LAYER: [[7, 8]]} and store.stats()["corrupt_pages"] == 1
        with pytest.raises(errors.CorruptRows, match="page 7 at file offset"):
            store.lookup(LAYER, rows_of(7)[:1])
        others = np.setdiff1d(np.arange(SPEC.rows(LAYER)), rows_of(7))
        np.testing.assert_array_equal(store.lookup(LAYER, others), ref.read_rows(LAYER, others))
        other_layer = SPEC.layers[1]
        all_rows = np.arange(SPEC.rows(other_layer))
        np.testing.assert_array_equal(store.lookup(other_layer, all_rows), truth(other_layer, all_rows))
        assert set(store.resident_views()) == {other_layer}  # callers' own gathers skip the damaged layer
        weights, scales = store.parts.arena.blocks[LAYER]
        assert not weights[rows_of(7)].any() and not scales[rows_of(7)].any()  # no corrupt byte left in the arena


def test_a_read_error_in_the_fill_marks_only_the_pages_that_cannot_be_read(pristine):
    """A chunk read fails (any read touching page 11: an I/O error there): the chunk is read
    again by halves, page 11 alone is refused, every other row of the chunk is filled."""
    ts = TableSet.open(pristine)
    e = ts.manifest.layer(LAYER)
    with TieredStore.open(pristine, dram_bytes=1 << 20, mode="cached") as store:
        lf = store.parts.files[LAYER]
        real = np.fromfile(pristine / e.file, dtype=np.uint8)
        reads = []

        def bulk_read(lf, offset, nbytes, buf):
            reads.append((offset // PAGE_BYTES, nbytes // PAGE_BYTES))
            if offset <= 11 * PAGE_BYTES < offset + nbytes:
                raise errors.StorageError("injected: EIO")
            np.frombuffer(buf, dtype=np.uint8)[:nbytes] = real[offset : offset + nbytes]

        weights = np.empty((e.rows, SPEC.row_format.dim), dtype=np.uint8)
        scales = np.empty((e.rows, SPEC.row_bytes - SPEC.row_format.dim), dtype=np.uint8)
        bad = fill_split(weights, scales, lf, bulk_read, chunk_bytes=8 * PAGE_BYTES)
    np.testing.assert_array_equal(bad, [11])
    assert len(reads) <= -(-e.layout.pages // 8) + 2 * 3  # each chunk once, then two halves per level of 8 pages
    rows = np.concatenate([weights, scales], axis=1)
    lost = rows_of(11)
    kept = np.setdiff1d(np.arange(e.rows), lost)
    np.testing.assert_array_equal(rows[kept], truth(LAYER, kept))
    assert not rows[lost].any()


def test_the_scrub_finds_a_cold_corrupt_page(tables):
    with TieredStore.open(tables, dram_bytes=1 << 20, mode="cached", scrub_bytes_per_second=1 << 30) as store:
        flip(tables, SPEC.layers[1], 11)
        deadline = time.monotonic() + 20
        while store.stats()["corrupt_pages"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the scrub thread's progress, bounded by the deadline
        st = store.stats()
        assert st["corrupt_pages"] == 1 and st["scrub_bytes"] > 0, st
        assert store.bad_pages() == {SPEC.layers[1]: [[11, 12]]}
        assert st["requests"] == 0  # found by the scrub alone, before any lookup


# --- real daemons -----------------------------------------------------------------------
def _metric(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_cached_daemon_refuses_flipped_rows_over_unix_and_grpc(tables, tmp_path):
    from gpu_client import EngramClient

    (tmp_path / "run").mkdir()
    ref = TableSet.open(tables)
    with DaemonProcess(tables, tmp_path / "run", dram_bytes="256KiB", extra=["--store-mode", "cached",
                                                                          "--scrub-bytes-per-second", "0"]) as d:
        unix = EngramClient.connect(d.unix)
        grpc = EngramClient.connect(d.grpc, token_file=d.token_file)
        try:
            assert unix.info()["mode"] == "cached"
            flip(tables, LAYER, 30)
            flip(tables, LAYER, 31, at=9)
            for client, page in ((unix, 30), (grpc, 31)):
                with pytest.raises(errors.StorageError, match=f"corrupt page.*page {page} at file offset {page * PAGE_BYTES}"):
                    client.lookup(LAYER, np.array([0, 1, rows_of(page)[3]]))
            others = np.setdiff1d(np.arange(0, SPEC.rows(LAYER), 13), np.concatenate([rows_of(30), rows_of(31)]))
            for client in (unix, grpc):
                np.testing.assert_array_equal(client.lookup(LAYER, others), expected(ref, LAYER, others))
                np.testing.assert_array_equal(client.lookup(LAYER, others), truth(LAYER, others))
            for client in (unix, grpc):
                assert client.stats()["store_corrupt_pages"] == 2
            assert unix.info()["bad_pages"] == {str(LAYER): [[30, 32]]}
            assert _metric(d.ready["metrics"], "engram_store_corrupt_pages_total") == 2
            assert "corrupt page: layer %d page 30 (file offset %d" % (LAYER, 30 * PAGE_BYTES) in d.log_text()
        finally:
            unix.close()
            grpc.close()


def test_resident_daemon_starts_with_a_corrupt_page_and_refuses_only_its_rows(tables, tmp_path):
    from gpu_client import EngramClient

    (tmp_path / "run").mkdir()
    flip(tables, LAYER, 12)
    ref = TableSet.open(tables)
    with DaemonProcess(tables, tmp_path / "run", extra=["--store-mode", "resident"]) as d:
        unix = EngramClient.connect(d.unix)
        grpc = EngramClient.connect(d.grpc, token_file=d.token_file)
        try:
            info = unix.info()
            assert info["mode"] == "resident" and info["bad_pages"] == {str(LAYER): [[12, 13]]}
            assert info["layers"] == list(SPEC.layers)  # the damaged layer is still served
            for client in (unix, grpc):
                with pytest.raises(errors.StorageError, match="page 12 at file offset"):
                    client.lookup(LAYER, rows_of(12)[2:4])
                others = np.setdiff1d(np.arange(SPEC.rows(LAYER)), rows_of(12))
                np.testing.assert_array_equal(client.lookup(LAYER, others), expected(ref, LAYER, others))
                whole = np.arange(SPEC.rows(SPEC.layers[1]))
                np.testing.assert_array_equal(client.lookup(SPEC.layers[1], whole), truth(SPEC.layers[1], whole))
            st = unix.stats()
            assert st["store_corrupt_pages"] == 1 and st["store_corrupt_rows_refused"] == 4
            assert st["unix_native_requests"] == 1  # the clean layer's lookup went native, the damaged one's not
        finally:
            unix.close()
            grpc.close()


def test_memory_tables_refuse_a_corrupt_page(tables):
    """The no-daemon baseline checks every page as it loads: a flipped byte stops the load,
    naming layer and page, instead of serving the row."""
    from engram_store.client.local import MemoryTables

    MemoryTables.load(tables).close()  # pristine: loads
    flip(tables, LAYER, 2)
    with pytest.raises(errors.CorruptRows, match=rf"layer {LAYER}: 1 page\(s\) .* page 2, offset {2 * PAGE_BYTES}"):
        MemoryTables.load(tables)
