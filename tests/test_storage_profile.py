"""Access profiles: written from live traffic, read back for warm-up."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from support.storage_helpers import TINY, cache_budget, check_rows, make_tables

from engram_store import TieredStore
from engram_store.errors import ConfigError
from engram_store.storage.profile import AccessSampler, merge_hottest, read_profile


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables"), TINY)


def test_profile_round_trip_warms_the_cache(tables, tmp_path):
    budget = cache_budget(TINY, 0.1)
    hot = {1: np.arange(100, 400, 3), 3: np.arange(7, 900, 11)}
    with TieredStore.open(tables, dram_bytes=budget) as live:
        for _ in range(4):
            for layer, rows in hot.items():
                live.lookup(layer, rows)
        written = live.write_profile(tmp_path / "hot.npy")
        assert written >= sum(len(r) for r in hot.values())
    pairs = read_profile(tmp_path / "hot.npy")
    assert pairs.shape[1] == 2 and set(np.unique(pairs[:, 0])) == {1, 3}
    with TieredStore.open(tables, dram_bytes=budget, warmup=tmp_path / "hot.npy") as warm:
        assert warm.stats()["cache_slots_used"] >= sum(len(r) for r in hot.values())
        for layer, rows in hot.items():
            out = warm.lookup(layer, rows)
            check_rows(warm, tables, TINY, layer, rows, out)
        s = warm.stats()
        assert s["rows_nvme"] == 0 and s["rows_dram"] == sum(len(r) for r in hot.values())


def test_warm_up_ignores_bad_rows_and_layers(tables, caplog):
    pairs = np.array([[1, 5], [1, -3], [1, 10**9], [42, 1], [3, 2]], dtype=np.int64)
    with TieredStore.open(tables, dram_bytes=cache_budget(TINY, 0.1)) as store:
        with caplog.at_level(logging.WARNING):
            assert store.warm_up(pairs) == 2
        assert "out of range" in caplog.text and "layer 42" in caplog.text
    with TieredStore.open(tables, dram_bytes=1 << 30) as resident:
        assert resident.warm_up(pairs) == 0


def test_malformed_profile(tmp_path):
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    with pytest.raises(ConfigError):
        read_profile(tmp_path / "bad.npy")
    np.save(tmp_path / "shape.npy", np.zeros((4, 3), np.int64))
    with pytest.raises(ConfigError, match="shape"):
        read_profile(tmp_path / "shape.npy")


def test_sampler_ranks_by_frequency():
    s = AccessSampler(capacity=1000, per_request=1000)
    s.record(1, np.array([5, 5, 5, 9]))
    s.record(3, np.array([5, 7, 7]))
    top = s.hottest()
    assert top[0].tolist() == [1, 5] and top[1].tolist() == [3, 7]
    merged = merge_hottest(np.array([[3, 7], [1, 1]]), top)
    assert merged[:2].tolist() == [[3, 7], [1, 1]] and len(merged) == 5


def test_the_daemon_saves_its_profile_at_stop_and_warms_up_from_it(tables, tmp_path):
    """``save_profile`` = ``warmup_profile``: the first start is cold (no file yet, not a config
    error), SIGTERM writes the hottest rows atomically, the next start has them cached."""
    from support.daemon_helpers import DaemonProcess

    from engram_store.client.client import EngramClient

    profile = tmp_path / "state" / "profile.npy"
    profile.parent.mkdir()
    extra = ["--store-mode", "cached", "--save-profile", str(profile), "--warmup-profile", str(profile)]
    budget = str(cache_budget(TINY, 0.1))
    hot = np.arange(100, 400, 3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with DaemonProcess(tables, tmp_path / "a", dram_bytes=budget, extra=extra) as daemon:
        with EngramClient.connect(daemon.unix) as client:
            for _ in range(3):
                client.lookup(1, hot)
        assert daemon.terminate() == 0
    pairs = read_profile(profile)
    assert {(1, int(r)) for r in hot} <= {tuple(map(int, p)) for p in pairs}
    assert [p.name for p in profile.parent.iterdir()] == ["profile.npy"]  # no temp file left
    with DaemonProcess(tables, tmp_path / "b", dram_bytes=budget, extra=extra) as daemon:
        with EngramClient.connect(daemon.unix) as client:
            assert client.stats()["store_cache_slots_used"] >= len(hot)
            out = client.lookup(1, hot)
            assert client.stats()["store_rows_nvme"] == 0
        check_rows(None, tables, TINY, 1, hot, out)


def test_save_profile_needs_a_writable_directory(tables, tmp_path):
    from engram_store.daemon.config import DaemonConfig
    from engram_store.daemon.preflight import preflight

    config = DaemonConfig(tables=str(tables), socket="", metrics="", save_profile=str(tmp_path / "nope" / "p.npy"))
    with pytest.raises(ConfigError, match="'save_profile'.*does not exist"):
        preflight(config)
