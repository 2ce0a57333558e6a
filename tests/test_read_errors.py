"""Read errors, played for real: a layer file cut short under a running cached daemon (a
transient short read) marks only the pages that cannot be read, a repaired file clears them,
plan and plain lookups agree throughout, and corrupt rows arrive as ``CorruptRows`` over both
transports. Then the plan executors' file identity: a table file the daemon replaced is opened
again (checked on every plan), a file that is not the daemon's is refused."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected, make_tables, wait_for
from support.storage_helpers import flip

from engram_store import errors
from engram_store.client import plan as client_plan
from engram_store.client.client import EngramClient
from engram_store.format.layout import PAGE_BYTES
from engram_store.format.tableset import TableSet
from engram_store.storage.tiered import TieredStore
from engram_store.wire import frames as wire

LAYER = 3
CUT = 200  # the file is cut to this many pages: pages CUT.. cannot be read


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> TableSet:
    return make_tables(tmp_path_factory.mktemp("read-errors") / "tiny", seed=17)


def rows_of(tables: TableSet, pages) -> np.ndarray:
    rpp = PAGE_BYTES // tables.row_bytes
    return (np.asarray(pages)[:, None] * rpp + np.arange(rpp)).reshape(-1)


def _plan(client: EngramClient, ids: np.ndarray) -> np.ndarray:
    out = np.empty((len(ids), client.row_bytes), np.uint8)
    client.lookup_planned(LAYER, ids, out)
    return out


def _both(client: EngramClient, ids: np.ndarray) -> list:
    """What a plain and a plan lookup of ``ids`` give: the rows, or the error's class and pages."""
    got = []
    for call in (lambda: client.lookup(LAYER, ids), lambda: _plan(client, ids)):
        try:
            got.append(call())
        except errors.CorruptRows as exc:
            got.append((type(exc), exc.layer, exc.pages))
    return got


def test_a_transient_short_read_marks_only_the_unreadable_pages_and_a_repair_clears_them(tables, tmp_path):
    copy = tmp_path / "tables"
    shutil.copytree(tables.directory, copy)
    path = copy / tables.manifest.layer(LAYER).file
    original = path.read_bytes()
    pages = len(original) // PAGE_BYTES
    (tmp_path / "run").mkdir()
    extra = ["--store-mode", "cached", "--scrub-bytes-per-second", "64MiB"]  # a pass over the set every ~30 ms
    with DaemonProcess(copy, tmp_path / "run", dram_bytes="256KiB", extra=extra) as d, \
            EngramClient.connect(d.unix) as client:
        good = rows_of(tables, [0, 57, CUT - 1])
        np.testing.assert_array_equal(client.lookup(LAYER, good), expected(tables, LAYER, good))
        os.truncate(path, CUT * PAGE_BYTES)  # reads of pages CUT.. now come back short
        wait_for(lambda: client.info()["bad_pages"].get(str(LAYER)), "the scrub marking the cut pages")
        assert client.info()["bad_pages"] == {str(LAYER): [[CUT, pages]]}  # those pages only, not the whole read
        lost = rows_of(tables, [CUT + 3])[[0, 5]]
        mixed = np.concatenate([good, lost])
        for ids in (lost, mixed):
            plain, planned = _both(client, ids)
            assert plain == planned == (errors.CorruptRows, LAYER, (CUT + 3,)), (plain, planned)
        for got in _both(client, good):  # the rest of the layer is served, by both
            np.testing.assert_array_equal(got, expected(tables, LAYER, good))
        with open(path, "r+b") as f:  # the repair: the same bytes back in place
            f.seek(CUT * PAGE_BYTES)
            f.write(original[CUT * PAGE_BYTES:])
        wait_for(lambda: not client.info()["bad_pages"], "the scrub clearing the repaired pages")
        for got in _both(client, mixed):
            np.testing.assert_array_equal(got, expected(tables, LAYER, mixed))
        assert client.stats()["store_corrupt_pages"] == 0
        log = d.log_text()
    # one line per page when it turns bad (at most 8, then a summary) and one when pages clear: not a
    # line per read per scrub pass (dozens of passes ran meanwhile)
    errors_logged = [line for line in log.splitlines() if " ERROR " in line]
    assert 0 < len(errors_logged) <= 9 + 1, "\n".join(errors_logged)
    assert sum("read good again" in line for line in log.splitlines()) >= 1


def test_corrupt_rows_arrive_as_corrupt_rows_over_both_transports(tables, tmp_path):
    copy = tmp_path / "tables"
    shutil.copytree(tables.directory, copy)
    (tmp_path / "run").mkdir()
    extra = ["--store-mode", "cached", "--scrub-bytes-per-second", "0"]
    with DaemonProcess(copy, tmp_path / "run", dram_bytes="256KiB", extra=extra) as d:
        flip(copy, LAYER, 40)  # after the start: found by the lookup's own read
        ids = np.concatenate([np.arange(10), rows_of(tables, [40])[[1, 7]]])
        for address, kw in ((d.unix, {}), (d.grpc, {"token_file": d.token_file})):
            with EngramClient.connect(address, **kw) as client:
                with pytest.raises(errors.CorruptRows, match=f"layer {LAYER}: .*page 40 at file offset") as err:
                    client.lookup(LAYER, ids)
                assert (err.value.layer, err.value.pages) == (LAYER, (40,)), address
                np.testing.assert_array_equal(client.lookup(LAYER, ids[:10]), expected(tables, LAYER, ids[:10]))


def test_the_wire_names_layer_and_pages_of_corrupt_rows():
    exc = errors.CorruptRows("layer 14: 3 row(s) asked (1, 2, 3) are in 2 corrupt page(s) (page 5 at file offset "
                             "20480 of /t/layer_014.bin, page 9 at file offset 36864 of /t/layer_014.bin: crc32c "
                             "mismatch)", 14, (5, 9))
    status = wire.status_of(exc)
    assert status == wire.Status.DATA_LOSS
    back = wire.error_of(status, f"LOOKUP failed: {exc}")
    assert isinstance(back, errors.CorruptRows) and (back.layer, back.pages) == (14, (5, 9))
    assert type(wire.error_of(wire.Status.INTERNAL, "disk gone")) is errors.StorageError


# --- the plan executors' file identity (CPU) ----------------------------------------------------------
def _plan_of(directory: Path, ids: np.ndarray):
    """A read plan of ``ids`` from a cached store on ``directory`` (nothing cached: every row planned)."""
    with TieredStore.open(directory, dram_bytes=256 << 10, mode="cached") as store:
        out = np.empty((len(ids), store.row_bytes), np.uint8)
        plan = store.plan_into(LAYER, ids, out, max_plan_bytes=1 << 20)
    assert plan is not None and len(plan.positions) == len(ids)
    return plan


def test_the_host_executor_opens_a_replaced_layer_file_again(tables, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(tables.directory, live)
    other = make_tables(tmp_path / "other", seed=99)  # the same spec, other bytes
    ids = np.arange(100, 400, 7)
    ex = client_plan.HostPlanExecutor()
    try:
        first = _plan_of(live, ids)
        out = np.empty((len(ids), tables.row_bytes), np.uint8)
        ex.execute(LAYER, first, out)
        np.testing.assert_array_equal(out, expected(tables, LAYER, ids))
        name = tables.manifest.layer(LAYER).file
        tmp = live / f".{name}.new"  # the table set replaced: a new file renamed over the old path
        shutil.copy(other.directory / name, tmp)
        os.replace(tmp, live / name)
        shutil.copy(other.directory / tables.manifest.layer(LAYER).crc_file, live / tables.manifest.layer(LAYER).crc_file)
        second = _plan_of(live, ids)  # the daemon (re)opened it: the plan names the new file
        assert second.st_ino != first.st_ino
        ex.execute(LAYER, second, out)
        np.testing.assert_array_equal(out, expected(other, LAYER, ids))  # read from the new file, not the kept fd
        assert ex._files.reopened == 1
        with pytest.raises(client_plan.PlanUnusable, match="not the file the daemon reads"):
            ex.execute(LAYER, first, out)  # a daemon still reading the old file: refused, never misread
    finally:
        ex.close()


class _FakeCuFile:
    """Stands in for ``kvikio.CuFile``: opens what it is given and remembers which file that was."""

    opened: list["_FakeCuFile"] = []

    def __init__(self, path: str, mode: str) -> None:
        assert mode == "r"
        self.fd = os.open(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino, st.st_size)
        self.closed = False
        _FakeCuFile.opened.append(self)

    def close(self) -> None:
        os.close(self.fd)
        self.closed = True


def test_the_kvikio_identity_logic_reopens_a_changed_file_and_closes_the_old_one_after_its_reads(tmp_path):
    path = tmp_path / "layer_003.bin"
    path.write_bytes(b"a" * PAGE_BYTES)
    files = client_plan.LayerFiles(lambda p: client_plan.open_cufile(p, _FakeCuFile), lambda f: f.close())

    def plan_for(p: Path):
        st = os.stat(p)
        return wire.ReadPlan(str(p), st.st_size, st.st_dev, st.st_ino, 66, np.zeros(0, np.int64),
                             np.zeros(0, np.uint32), np.zeros(0, np.int64), np.zeros(0, np.int64),
                             np.zeros(0, np.int64))

    first = plan_for(path)
    reading = threading.Event()
    with files.lease(first) as old:
        assert old.identity == client_plan.plan_identity(first)  # the CuFile reads the very file checked
        with files.lease(first) as again:
            assert again is old  # the same file: kept
        reading.set()
        (tmp_path / "new").write_bytes(b"b" * 2 * PAGE_BYTES)
        os.replace(tmp_path / "new", path)
        second = plan_for(path)
        with files.lease(second) as new:  # changed identity: opened again while the old one is still read
            assert new is not old and new.identity == client_plan.plan_identity(second)
            assert not old.closed  # a read in flight keeps its file
        with pytest.raises(client_plan.PlanUnusable, match="not the file the daemon reads"):
            with files.lease(first):
                pass
    assert old.closed and not new.closed  # retired once its last lease ended
    files.close()
    assert new.closed and all(f.closed for f in _FakeCuFile.opened)
