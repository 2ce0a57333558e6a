"""Plan mode: a cached daemon answers with the rows it holds in DRAM plus a read plan of the
others, which the client reads from the layer file itself and checks page by page.

Real cached daemons (and one resident), byte-exact against ``TableSet.read_rows``: cold
requests, warm ones, rows sharing pages and duplicates, the background admission of
planned rows, a layer file the client cannot open (falls back to the daemon, still exact),
a page corrupted on disk (the client's own check refuses it) and a resident layer (served
as a normal lookup). The wire format and the store's side are checked in process too.
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected, make_tables, wait_for
from support.storage_helpers import flip

from engram_store import errors
from engram_store.client import plan as client_plan
from engram_store.client import plan_device
from engram_store.client.client import EngramClient
from engram_store.format import checksums
from engram_store.format.layout import PAGE_BYTES
from engram_store.format.tableset import TableSet
from engram_store.storage.tiered import TieredStore
from engram_store.wire import frames as wire

CACHED = ["--store-mode", "cached", "--scrub-bytes-per-second", "0"]
LAYER = 1


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> TableSet:
    return make_tables(tmp_path_factory.mktemp("plan") / "tiny", seed=3)


@pytest.fixture(scope="module")
def daemon(tables, tmp_path_factory):
    d = DaemonProcess(tables.directory, tmp_path_factory.mktemp("plan-daemon"), dram_bytes="256KiB", extra=CACHED)
    try:
        d.start()
        assert d.ready["mode"] == "cached"
        yield d
    finally:
        d.stop()


def rpp(tables) -> int:
    return PAGE_BYTES // tables.row_bytes


def page_rows(tables, page: int) -> np.ndarray:
    return np.arange(page * rpp(tables), (page + 1) * rpp(tables), dtype=np.int64)


def delta(after: dict, before: dict, key: str) -> float:
    return after[key] - before[key]


def planned(client: EngramClient, layer: int, ids) -> np.ndarray:
    ids = np.asarray(ids)
    out = np.full(ids.shape + (client.row_bytes,), 0xEE, dtype=np.uint8)
    assert client.lookup_planned(layer, ids, out) is out
    return out


# --- through a real cached daemon ----------------------------------------------------------------
def test_cold_request_is_read_by_the_client(daemon, tables):
    ids = np.random.default_rng(1).choice(page_rows(tables, 20)[0] + np.arange(40 * rpp(tables)), 300, replace=False)
    with EngramClient.connect(daemon.unix) as client:
        before = client.stats()
        np.testing.assert_array_equal(planned(client, LAYER, ids), expected(tables, LAYER, ids))
        after = client.stats()
        info = client.plan_info()
    assert delta(after, before, "store_plan_requests") == 1
    assert delta(after, before, "store_plan_rows_planned") == len(ids)  # nothing of them was cached
    assert delta(after, before, "store_plan_rows_dram") == 0
    assert delta(after, before, "store_rows_nvme") == 0  # the daemon read none of them for the reply
    pages = len(np.unique(ids // rpp(tables)))
    assert delta(after, before, "store_plan_pages_planned") == pages
    assert info["executor"] == "host" and info["fallbacks"] == {} and info["pages_read"] == pages


def test_warm_request_mixes_cache_hits_and_plan(daemon, tables):
    rng = np.random.default_rng(2)
    warm = rng.choice(page_rows(tables, 70)[0] + np.arange(10 * rpp(tables)), 80, replace=False)
    cold = rng.choice(page_rows(tables, 90)[0] + np.arange(10 * rpp(tables)), 80, replace=False)
    with EngramClient.connect(daemon.unix) as client:
        client.lookup(LAYER, warm)  # a normal lookup admits them into the cache
        ids = rng.permutation(np.concatenate([warm, cold])).reshape(4, 40)
        before = client.stats()
        np.testing.assert_array_equal(planned(client, LAYER, ids), expected(tables, LAYER, ids))
        after = client.stats()
    hits = delta(after, before, "store_plan_rows_dram")
    assert hits > 0 and hits + delta(after, before, "store_plan_rows_planned") == ids.size
    assert delta(after, before, "store_plan_rows_planned") >= len(cold)


def test_rows_sharing_pages_and_duplicates(daemon, tables):
    p = 130
    a, b = page_rows(tables, p), page_rows(tables, p + 1)
    ids = np.array([a[0], a[3], a[5], a[5], b[1], a[-1], b[-1], a[3], b[1], b[2], a[0], a[7]], np.int64)
    with EngramClient.connect(daemon.unix) as client:
        t = client._current()
        out = np.full((len(ids), tables.row_bytes), 0xEE, np.uint8)
        plan = t.plan_lookup(LAYER, ids, out)
        assert plan is not None and plan.pages.tolist() == [p, p + 1]
        assert sorted(plan.positions.tolist()) == list(range(len(ids)))  # all cold, duplicates included
        np.testing.assert_array_equal(plan.pages[plan.page_index] * rpp(tables) + plan.slots, ids[plan.positions])
        # the same ids again, through lookup_planned, as a 3-d request (some may be cached by now)
        shaped = ids.reshape(2, 3, 2)
        np.testing.assert_array_equal(planned(client, LAYER, shaped), expected(tables, LAYER, shaped))
        np.testing.assert_array_equal(planned(client, 3, shaped), expected(tables, 3, shaped))


def test_planned_rows_are_admitted_in_the_background(daemon, tables):
    ids = page_rows(tables, 160)[::3]
    with EngramClient.connect(daemon.unix) as client:
        before = client.stats()
        np.testing.assert_array_equal(planned(client, LAYER, ids), expected(tables, LAYER, ids))
        wait_for(lambda: delta(client.stats(), before, "store_plan_admitted_rows") >= len(ids),
                 "the planned rows admitted into the daemon's cache")
        mid = client.stats()
        np.testing.assert_array_equal(client.lookup(LAYER, ids), expected(tables, LAYER, ids))
        after = client.stats()
    assert delta(mid, before, "store_plan_admit_queued_rows") == len(ids)
    assert delta(after, mid, "store_rows_dram") == len(ids)  # a later normal lookup: all hits
    assert delta(after, mid, "store_rows_nvme") == 0


def test_a_layer_file_the_client_cannot_open_falls_back(daemon, tables, monkeypatch):
    def refuse(self, path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(client_plan.HostPlanExecutor, "opener", refuse)
    ids = np.random.default_rng(4).choice(page_rows(tables, 100)[0] + np.arange(20 * rpp(tables)), 200, replace=False)
    with EngramClient.connect(daemon.unix) as client:
        before = client.stats()
        np.testing.assert_array_equal(planned(client, LAYER, ids), expected(tables, LAYER, ids))
        info = client.plan_info()
        assert set(info["fallbacks"]) == {LAYER} and "Permission denied" in info["fallbacks"][LAYER]
        assert info["pages_read"] == 0
        mid = client.stats()
        assert delta(mid, before, "store_plan_requests") == 1  # the plan, then the daemon read the misses
        more = np.arange(5000, 5300)
        np.testing.assert_array_equal(planned(client, LAYER, more), expected(tables, LAYER, more))
        assert delta(client.stats(), mid, "store_plan_requests") == 0  # from then on: plain lookups


def test_a_resident_layer_is_served_as_a_normal_lookup(tables, tmp_path):
    ids = np.random.default_rng(5).integers(0, tables.rows(LAYER), (6, 24))
    for extra in ([], ["--no-unix-native"]):
        with DaemonProcess(tables.directory, tmp_path, extra=["--store-mode", "resident", *extra]) as d, \
                EngramClient.connect(d.unix) as client:
            t = client._current()
            out = np.empty((ids.size, tables.row_bytes), np.uint8)
            assert t.plan_lookup(LAYER, ids, out) is None  # every row written by the daemon
            np.testing.assert_array_equal(out, expected(tables, LAYER, ids.reshape(-1)))
            np.testing.assert_array_equal(planned(client, LAYER, ids), expected(tables, LAYER, ids))
            assert client.plan_info()["pages_read"] == 0
            if extra:  # the Python path counts it as a plan request served whole
                assert client.stats()["store_plan_rows_served"] == 2 * ids.size


def test_a_corrupt_page_is_refused_by_the_client(tables, tmp_path):
    copy = tmp_path / "tables"
    shutil.copytree(tables.directory, copy)
    (tmp_path / "run").mkdir()
    with DaemonProcess(copy, tmp_path / "run", dram_bytes="256KiB", extra=CACHED) as d, \
            EngramClient.connect(d.unix) as client:
        flip(copy, LAYER, 40)  # after the daemon started: it has no copy of the page
        bad_rows = page_rows(tables, 40)[[2, 9]]
        ids = np.concatenate([np.arange(10), bad_rows])
        out = np.full((len(ids), tables.row_bytes), 0xEE, np.uint8)
        with pytest.raises(errors.CorruptRows, match="page.*40") as err:
            client.lookup_planned(LAYER, ids, out)
        assert err.value.layer == LAYER and err.value.pages == (40,)
        assert (out[-2:] == 0xEE).all()  # no byte of the corrupt page was returned
        others = page_rows(tables, 50)
        np.testing.assert_array_equal(planned(client, LAYER, others), expected(tables, LAYER, others))
        # the daemon's background admission read the page too, and now refuses its rows itself
        wait_for(lambda: client.stats()["store_corrupt_pages"] >= 1, "the daemon marking page 40 corrupt")
        with pytest.raises(errors.StorageError, match="corrupt"):
            client.lookup_planned(LAYER, bad_rows, np.empty((2, tables.row_bytes), np.uint8))


# --- in process: the store's side and the wire format ---------------------------------------------
def test_the_store_serves_whole_when_a_plan_is_too_large(tables):
    with TieredStore.open(tables.directory, dram_bytes=256 << 10, mode="cached") as store:
        ids = np.arange(1000, 1400)
        out = np.empty((len(ids), tables.row_bytes), np.uint8)
        assert store.plan_into(LAYER, ids, out, max_plan_bytes=100) is None
        np.testing.assert_array_equal(out, tables.read_rows(LAYER, ids))
        plan = store.plan_into(LAYER, np.arange(2000, 2100), out[:100], max_plan_bytes=wire.MAX_DAEMON_PAYLOAD)
        assert plan is not None and len(plan.positions) == 100
        stats = store.stats()
        assert stats["plan_rows_served"] == 400 and stats["plan_rows_planned"] == 100
        with pytest.raises(errors.RowOutOfRange):
            store.plan_into(LAYER, np.array([tables.rows(LAYER)]), out[:1], max_plan_bytes=1 << 20)


def test_read_plan_round_trip_and_malformed_plans():
    plan = wire.ReadPlan("/tables/layer_01.bin", 10 * PAGE_BYTES, 7, 9, 66, np.array([2, 3, 8]),
                         np.array([1, 2, 3], np.uint32), np.array([4, 0, 2, 1]), np.array([0, 2, 2, 1]),
                         np.array([0, 61, 61, 5]))
    payload = plan.pack()
    assert len(payload) == wire.ReadPlan.nbytes(len(plan.path), 3, 4)
    got = wire.ReadPlan.unpack(payload, 5)
    for name in ("path", "file_bytes", "st_dev", "st_ino", "row_bytes", "page_bytes"):
        assert getattr(got, name) == getattr(plan, name)
    for name in ("pages", "crcs", "positions", "page_index", "slots"):
        np.testing.assert_array_equal(getattr(got, name), getattr(plan, name))
    with pytest.raises(wire.ProtocolError, match="out of range"):
        wire.ReadPlan.unpack(payload, 4)  # position 4 in a 4-row request
    with pytest.raises(wire.ProtocolError, match="bytes"):
        wire.ReadPlan.unpack(payload[:-1], 5)
    with pytest.raises(wire.ProtocolError, match="ascending"):
        wire.ReadPlan.unpack(wire.ReadPlan(**{**plan.__dict__, "pages": np.array([3, 2, 8])}).pack(), 5)


def test_device_crc_matches_the_reference():
    torch = pytest.importorskip("torch")
    pages = np.random.default_rng(0).integers(0, 256, (7, PAGE_BYTES), dtype=np.uint8)
    pages[3] = 0
    crc = plan_device.DeviceCrc("cpu")
    got = crc(torch.from_numpy(pages)).numpy()
    np.testing.assert_array_equal(got, checksums.page_crcs(pages).astype(np.int64))


def test_read_extents_coalesce_runs():
    from engram_store.format.layout import extents

    begin, n = extents(np.array([1, 2, 3, 7, 8, 20, 21, 22, 23, 24]), 3)
    assert begin.tolist() == [0, 3, 5, 8] and n.tolist() == [3, 2, 3, 2]


def test_the_prefetcher_reads_cold_rows_by_plan_when_asked(tmp_path):
    """EngramPrefetcher(plan=True) over a cached daemon: cold rows read by this process, pages
    checked, rows byte-exact over a churn of steps; info() reports the plan executor."""
    from support.daemon_helpers import DaemonProcess
    from support.daemon_helpers import make_tables as make_daemon_tables
    from test_gpu_client_daemon import churn

    from engram_store.client.client import EngramClient
    from gpu_client import EngramPrefetcher

    ts = make_daemon_tables(tmp_path / "tiny")
    (tmp_path / "d").mkdir()
    with DaemonProcess(ts.directory, tmp_path / "d", dram_bytes="64KiB") as daemon:
        with EngramClient.connect(daemon.unix) as client:
            with EngramPrefetcher(client, max_tokens=64, plan=True) as pf:
                assert pf.plan and not pf._async
                churn(pf, ts, seed=5, max_len=20)
                info = pf.info()["plan"]
                assert info["executor"] == "host" and info["pages_read"] > 0 and not info["fallbacks"]
            with EngramPrefetcher(client, max_tokens=64) as pf:
                assert not pf.plan and pf.info()["plan"] is None  # off by default: no gain on the host


def test_plan_counters_reach_prometheus(tables, tmp_path):
    import urllib.request

    from support.daemon_helpers import DaemonProcess

    from engram_store.client.client import EngramClient

    (tmp_path / "d").mkdir()
    with DaemonProcess(tables.directory, tmp_path / "d", dram_bytes="64KiB",
                       extra=["--metrics", "127.0.0.1:0"]) as daemon:
        with EngramClient.connect(daemon.unix) as client:
            ids = np.arange(0, 3000, 7)
            out = np.empty((ids.size, tables.row_bytes), np.uint8)
            client.lookup_planned(1, ids, out)
        text = urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics", timeout=10).read().decode()
        m = re.search(r"^engram_store_plan_rows_planned_total (\S+)$", text, re.M)
        assert m and float(m.group(1)) > 0, text[:2000]
