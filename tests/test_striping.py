"""Striped table sets: a layer's pages dealt round-robin over K stripe files, one per directory.

A striped set must read byte for byte as the unstriped set of the same seed
(and as synth_rows) through every reader: the reference TableSet, the store in
cached mode (cold and warm) and resident mode, and a real daemon. A flipped byte
in one stripe is refused by layer page; a truncated stripe makes its layer
unavailable and the other layers serve; an interrupted writer leaves nothing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess
from support.storage_helpers import FLASH, TINY

from engram_store import errors
from engram_store.format import writer as writer_mod
from engram_store.format.layout import PAGE_BYTES, PageLayout
from engram_store.format.manifest import Manifest
from engram_store.format.tableset import TableSet
from engram_store.storage.layer_file import open_layer
from engram_store.storage.tiered import TieredStore
from engram_store.tools.synth import synth_rows, write_synthetic

SEED = 23


def _block_rows(spec) -> int:
    """Blocks of 67 pages: not a multiple of K, so blocks start on every stripe."""
    return 67 * PageLayout(0, spec.row_bytes).rows_per_page


def make_striped(root, spec, k: int, name: str = "striped"):
    dirs = [root / f"dev{i}" for i in range(k)]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    out = root / name
    write_synthetic(out, spec, seed=SEED, stripe_dirs=dirs, block_rows=_block_rows(spec))
    return out, dirs


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "flash"
    write_synthetic(out, FLASH, seed=SEED)
    return TableSet.open(out)


@pytest.fixture(scope="module", params=[2, 3])
def striped(request, tmp_path_factory):
    out, _ = make_striped(tmp_path_factory.mktemp(f"k{request.param}"), FLASH, request.param)
    return out


def _request(spec, layer: int, seed: int, n: int = 3000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, spec.rows(layer), size=n)


def _truth(plain: TableSet, layer: int, ids: np.ndarray) -> np.ndarray:
    ref = plain.read_rows(layer, ids)
    np.testing.assert_array_equal(ref, synth_rows(plain.spec, SEED, layer, ids))
    return ref


def test_manifest_and_layout_rule(striped):
    manifest = Manifest.load(striped)
    for e in manifest.layers:
        k_total = len(e.stripes)
        assert k_total in (2, 3)
        pages = e.layout.pages
        assert [s.file_bytes // PAGE_BYTES for s in e.stripes] == [-(-(pages - k) // k_total) for k in range(k_total)]
        assert not (striped / e.file).exists()  # the layer's pages live only in its stripes
        # page p of the layer is stripe p % K at (p // K) * 4096
        expect = PageLayout(e.rows, e.row_bytes).pack(synth_rows(FLASH, SEED, e.layer, np.arange(e.rows)))
        for k, s in enumerate(e.stripes):
            on_disk = np.fromfile(s.file, dtype=np.uint8).reshape(-1, PAGE_BYTES)
            np.testing.assert_array_equal(on_disk, expect[k::k_total])


def test_reference_reader_and_verify(striped, plain):
    ts = TableSet.open(striped)
    for layer in ts.layers:
        ids = np.arange(ts.rows(layer))
        np.testing.assert_array_equal(ts.read_rows(layer, ids), _truth(plain, layer, ids))
        np.testing.assert_array_equal(ts.read_pages(layer), plain.read_pages(layer))
    assert ts.verify() == []
    res = subprocess.run([sys.executable, "-m", "engram_store", "verify", str(striped)], capture_output=True, text=True, check=False)
    assert res.returncode == 0 and "ok:" in res.stdout


@pytest.mark.parametrize("reader", ["uring", "aio", "threads"])
def test_cached_store_cold_and_warm(striped, plain, reader):
    from engram_store.native.readers import aio, uring

    if reader == "uring" and uring.probe():
        pytest.skip(f"io_uring unavailable: {uring.probe()}")
    if reader == "aio" and aio.native_reader() is None:
        pytest.skip("native reader _pread not built")
    with TieredStore.open(striped, dram_bytes=4 << 20, mode="cached", reader=reader) as store:
        assert store.layer_errors() == {}
        for layer in plain.layers:
            ids = _request(FLASH, layer, seed=layer)
            cold = store.lookup(layer, ids)
            np.testing.assert_array_equal(cold, _truth(plain, layer, ids))
            np.testing.assert_array_equal(store.lookup(layer, ids), cold)  # warm: cached rows and re-reads
            every = np.arange(plain.rows(layer))
            np.testing.assert_array_equal(store.lookup(layer, every), _truth(plain, layer, every))


def test_resident_store(striped, plain):
    with TieredStore.open(striped, dram_bytes=1 << 30, mode="resident") as store:
        for layer in plain.layers:
            every = np.arange(plain.rows(layer))
            np.testing.assert_array_equal(store.lookup(layer, every), _truth(plain, layer, every))


def test_resident_fill_in_small_chunks(tmp_path, plain):
    """Several chunks per stripe: the fill maps each stripe's local pages back to layer pages."""
    from engram_store.native.readers import open_reader
    from engram_store.storage import resident
    from engram_store.storage.gds import posix_bulk_reader

    out, _ = make_striped(tmp_path, FLASH, 3)
    manifest = Manifest.load(out)
    lf = open_layer(out, manifest.layers[0])
    rows, wb = lf.layout.rows, FLASH.row_format.dim
    weights = np.zeros((rows, wb), np.uint8)
    scales = np.zeros((rows, FLASH.row_bytes - wb), np.uint8)
    reader = open_reader(8, "threads")
    try:
        bad = resident.fill_split(weights, scales, lf, posix_bulk_reader(reader), 16 * PAGE_BYTES)
    finally:
        reader.close()
        lf.close()
    assert len(bad) == 0
    np.testing.assert_array_equal(np.hstack([weights, scales]), _truth(plain, manifest.layers[0].layer, np.arange(rows)))


def _flip(path, local_page: int, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(local_page * PAGE_BYTES + at)
        b = f.read(1)
        f.seek(local_page * PAGE_BYTES + at)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("mode", ["cached", "resident"])
def test_flipped_byte_in_one_stripe_is_refused_by_layer_page(tmp_path, plain, mode):
    out, _ = make_striped(tmp_path, FLASH, 3)
    e = Manifest.load(out).layers[0]
    layer, rpp = e.layer, e.layout.rows_per_page
    _flip(e.stripes[2].file, 5)  # stripe 2, local page 5: layer page 2 + 3 * 5
    page = 17
    assert [c.page for c in TableSet.open(out).verify()] == [page]
    with TieredStore.open(out, dram_bytes=1 << 30 if mode == "resident" else 4 << 20, mode=mode) as store:
        stripe_file = re.escape(str(e.stripes[2].file))
        with pytest.raises(errors.CorruptRows, match=rf"layer {layer}: .*page {page} at file offset {5 * PAGE_BYTES} of "
                                                     rf"\S*{stripe_file}:"):
            store.lookup(layer, np.array([0, page * rpp + 3, 5000]))
        others = np.setdiff1d(np.arange(e.rows), np.arange(page * rpp, (page + 1) * rpp))
        np.testing.assert_array_equal(store.lookup(layer, others), _truth(plain, layer, others))
        assert store.bad_pages() == {layer: [[page, page + 1]]}


def test_scrub_finds_a_flipped_stripe_page(tmp_path):
    out, _ = make_striped(tmp_path, FLASH, 2)
    e = Manifest.load(out).layers[-1]
    _flip(e.stripes[1].file, 40)  # layer page 1 + 2 * 40
    with TieredStore.open(out, dram_bytes=4 << 20, mode="cached", scrub_bytes_per_second=1 << 30) as store:
        for _ in range(2000):
            if store.bad_pages():
                break
            time.sleep(0.01)
        assert store.bad_pages() == {e.layer: [[81, 82]]}


def test_truncated_stripe_makes_only_its_layer_unavailable(tmp_path, plain):
    out, _ = make_striped(tmp_path, FLASH, 2)
    manifest = Manifest.load(out)
    bad, good = manifest.layers[0], manifest.layers[1]
    with open(bad.stripes[1].file, "r+b") as f:
        f.truncate(bad.stripes[1].file_bytes - PAGE_BYTES)
    lf = open_layer(out, bad)
    assert lf.file is None and "stripe 1 of 2" in lf.error and "truncated" in lf.error
    with pytest.raises(errors.TableFormatError, match="truncated"):
        TableSet.open(out)
    with TieredStore.open(out, dram_bytes=4 << 20, mode="cached") as store:
        assert list(store.layer_errors()) == [bad.layer]
        with pytest.raises(errors.StorageError, match=f"layer {bad.layer} is unavailable"):
            store.lookup(bad.layer, np.arange(10))
        ids = _request(FLASH, good.layer, seed=3)
        np.testing.assert_array_equal(store.lookup(good.layer, ids), _truth(plain, good.layer, ids))


def _leftovers(*dirs):
    return sorted(p.name for d in dirs for p in d.iterdir())


@pytest.mark.parametrize("failure", [OSError("simulated I/O error"), KeyboardInterrupt()])
def test_writer_failure_leaves_nothing(tmp_path, monkeypatch, failure):
    """An error or Ctrl-C mid-layer (stripe files open and partly written) leaves no file anywhere."""
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    real = writer_mod.page_crcs
    calls = []

    def failing(pages, *a):
        calls.append(1)
        if len(calls) == 3:
            raise failure
        return real(pages, *a)

    monkeypatch.setattr(writer_mod, "page_crcs", failing)
    with pytest.raises(type(failure)):
        write_synthetic(tmp_path / "out" / "ts", FLASH, seed=1, stripe_dirs=dirs, block_rows=_block_rows(FLASH))
    assert _leftovers(*dirs) == [] and _leftovers(tmp_path / "out") == []


def test_writer_failure_at_publish_leaves_nothing(tmp_path, monkeypatch):
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    monkeypatch.setattr(writer_mod.TableSetWriter, "_publish_dir", lambda self: (_ for _ in ()).throw(OSError("boom")))
    with pytest.raises(OSError, match="boom"):
        write_synthetic(tmp_path / "ts", TINY, seed=1, stripe_dirs=dirs)
    assert _leftovers(*dirs) == [] and [p.name for p in tmp_path.iterdir() if p.name.startswith(".ts")] == []


def test_writer_rejects_one_stripe_dir(tmp_path):
    with pytest.raises(errors.TableFormatError, match="at least two"):
        write_synthetic(tmp_path / "ts", TINY, stripe_dirs=[tmp_path])


def test_cli_synth_stripes_and_verify_finds_flip(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    out = tmp_path / "ts"
    res = subprocess.run([sys.executable, "-m", "engram_store", "synth", "--model", "tiny", "--seed", str(SEED),
                          "--out", str(out), "--stripe-dir", str(dirs[0]), "--stripe-dir", str(dirs[1])],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    e = Manifest.load(out).layers[0]
    assert [s.file for s in e.stripes] == [str(dirs[k] / f"ts.layer_{e.layer:03d}.s{k}.bin") for k in range(2)]
    info = json.loads(subprocess.run([sys.executable, "-m", "engram_store", "info", str(out)], capture_output=True,
                                     text=True, check=True).stdout)
    assert info["layers"][0]["stripes"] == [s.file for s in e.stripes]
    _flip(e.stripes[1].file, 3)  # layer page 7
    res = subprocess.run([sys.executable, "-m", "engram_store", "verify", str(out)], capture_output=True, text=True, check=False)
    assert res.returncode == 1 and f"layer {e.layer}: page 7 " in res.stderr and "ts.layer_" in res.stderr


def test_cached_daemon_over_unix(tmp_path):
    from gpu_client import EngramClient

    out, _ = make_striped(tmp_path, TINY, 2)
    (tmp_path / "run").mkdir()
    plain_dir = tmp_path / "plain"
    write_synthetic(plain_dir, TINY, seed=SEED)
    ref = TableSet.open(plain_dir)
    with DaemonProcess(out, tmp_path / "run", dram_bytes="256KiB",  # verify on: every stripe is checked at start
                       extra=["--store-mode", "cached", "--scrub-bytes-per-second", "0"]) as d, \
            EngramClient.connect(d.unix) as client:
        assert client.info()["mode"] == "cached"
        for layer in ref.layers:
            for seed in (0, 1, 0):  # cold, cold, then warm
                ids = np.random.default_rng(seed).integers(0, ref.rows(layer), size=(4, 500))
                got = client.lookup(layer, ids)
                want = ref.read_rows(layer, ids.reshape(-1)).reshape(got.shape)
                np.testing.assert_array_equal(got, want)
                np.testing.assert_array_equal(got.reshape(-1, TINY.row_bytes),
                                              synth_rows(TINY, SEED, layer, ids.reshape(-1)))


def test_nvme_tier_reads_stripes_concurrently_with_a_ring_each(tmp_path, plain):
    """One request touching every stripe is read by K threads (each uring thread has its own
    ring); rows land at their positions and a bad page comes back as a layer page number."""
    import threading

    from engram_store.native.readers import open_reader, uring
    from engram_store.storage.nvme import NvmeTier

    out, _ = make_striped(tmp_path, FLASH, 3)
    e = Manifest.load(out).layers[0]
    _flip(e.stripes[1].file, 2)  # layer page 1 + 3 * 2
    real = open_reader(16, "uring" if uring.probe() is None else "threads")
    seen: dict[int, set] = {}
    lock = threading.Lock()

    class Recording:
        name, queue_depth, streams_rows = real.name, real.queue_depth, real.streams_rows

        def _note(self, fd):
            with lock:
                seen.setdefault(fd, set()).add(threading.current_thread().name)

        def read(self, fd, *a, **kw):
            self._note(fd)
            return real.read(fd, *a, **kw)

        def read_rows(self, fd, *a, **kw):
            self._note(fd)
            return real.read_rows(fd, *a, **kw)

    lf = open_layer(out, e)
    tier = NvmeTier({e.layer: lf}, Recording())
    try:
        rows = np.unique(np.append(_request(FLASH, e.layer, seed=9, n=5000), 7 * e.layout.rows_per_page + 2))
        got = np.empty((len(rows), FLASH.row_bytes), np.uint8)
        stats = tier.read_rows(e.layer, rows, got)
        assert sorted(seen) == sorted(s.file.fd for s in lf.stripes)  # every stripe by its own descriptor
        assert len(set().union(*seen.values())) == 3  # the caller and two pool threads
        assert stats.bad_pages.tolist() == [7]
        good = np.flatnonzero(rows // e.layout.rows_per_page != 7)
        np.testing.assert_array_equal(got[good], _truth(plain, e.layer, rows[good]))
        assert stats.pages == len(np.unique(rows // e.layout.rows_per_page))
    finally:
        tier.close()
        real.close()


def test_more_stripes_than_pages_leaves_empty_stripes(tmp_path):
    from engram_store.models.spec import get_spec

    spec = get_spec("tiny", 0.0001)  # layer 1: 4 pages, over 6 stripes
    dirs = [tmp_path / f"d{i}" for i in range(6)]
    for d in dirs:
        d.mkdir()
    write_synthetic(tmp_path / "ts", spec, seed=SEED, stripe_dirs=dirs)
    ts = TableSet.open(tmp_path / "ts")
    assert [s.file_bytes for s in ts.manifest.layer(1).stripes] == [PAGE_BYTES] * 4 + [0, 0]
    assert ts.verify() == []
    for mode, dram in (("cached", 1 << 20), ("resident", 1 << 30)):
        with TieredStore.open(tmp_path / "ts", dram_bytes=dram, mode=mode) as store:
            for layer in spec.layers:
                ids = np.arange(spec.rows(layer))
                np.testing.assert_array_equal(store.lookup(layer, ids), synth_rows(spec, SEED, layer, ids))


def test_memory_tables_load_a_striped_set(tmp_path, plain):
    from engram_store.client.local import MemoryTables

    out, _ = make_striped(tmp_path, FLASH, 3)
    tables = MemoryTables.load(out)
    try:
        for layer in tables.layers:
            ids = np.random.default_rng(layer).integers(0, tables.rows(layer), size=300)
            np.testing.assert_array_equal(tables.lookup(layer, ids), _truth(plain, layer, ids))
    finally:
        tables.close()
