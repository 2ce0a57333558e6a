"""Per-layer placement: some layers resident (dense arena), others cached, through the store and the daemon."""

from __future__ import annotations

import json
import re
import urllib.request

import numpy as np
import pytest
import torch
from support.daemon_helpers import DaemonProcess, expected
from support.daemon_helpers import make_tables as make_daemon_tables

from engram_store import TieredStore, errors
from engram_store.client.client import EngramClient
from engram_store.daemon.config import DaemonConfig
from engram_store.daemon.preflight import preflight
from engram_store.format.tableset import TableSet
from engram_store.integrations.tables import EngramStoreTables
from engram_store.models.spec import get_spec
from engram_store.storage.placement import parse_placement, plan_placement, slot_bytes
from engram_store.storage.resident import resident_layout

TINY = get_spec("tiny")
FIRST, LAST = TINY.layers  # 1 and 3
ONE_LAYER = resident_layout([(FIRST, TINY.rows(FIRST))], TINY.row_format).size  # 4 MiB: two 2 MiB blocks
MIXED_DRAM = ONE_LAYER + (1 << 20)  # the first layer and a 1 MiB cache


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> TableSet:
    return make_daemon_tables(tmp_path_factory.mktemp("tables") / "tiny")


def plan(dram_bytes: int, mode: str = "auto", asked: dict | None = None) -> dict[int, str]:
    return plan_placement({layer: TINY.rows(layer) for layer in TINY.layers}, dram_bytes=dram_bytes, mode=mode,
                          asked=asked or {}, arena_bytes=lambda lr: resident_layout(lr, TINY.row_format).size,
                          slot_bytes=slot_bytes(TINY.row_bytes, "s3fifo"))


def test_auto_places_the_earliest_layers_resident_first():
    assert plan(64 << 20) == {FIRST: "resident", LAST: "resident"}
    assert plan(MIXED_DRAM) == {FIRST: "resident", LAST: "cached"}
    assert plan(ONE_LAYER) == {FIRST: "cached", LAST: "cached"}  # no room left for the other layer's cache
    assert plan(1 << 20) == {FIRST: "cached", LAST: "cached"}
    assert plan(MIXED_DRAM, asked={FIRST: "cached"}) == {FIRST: "cached", LAST: "resident"}


def test_placement_errors_name_the_layer_and_the_bytes():
    with pytest.raises(errors.ConfigError, match=r"layer\(s\) \[7\] that the table set does not hold"):
        plan(64 << 20, asked={7: "resident"})
    with pytest.raises(errors.ConfigError, match=rf"resident layer\(s\) \[{FIRST}, {LAST}\] need \d+ bytes"):
        plan(MIXED_DRAM, asked={FIRST: "resident", LAST: "resident"})
    with pytest.raises(errors.ConfigError, match="against mode='cached'"):
        plan(64 << 20, mode="cached", asked={FIRST: "resident"})
    with pytest.raises(errors.ConfigError, match=r"leaves no cache slot"):
        plan(ONE_LAYER, asked={FIRST: "resident"})
    assert parse_placement("1=resident, 14=cached") == {1: "resident", 14: "cached"}
    assert parse_placement({"1": "Resident"}) == {1: "resident"}
    for bad, why in [("1=dram", "not one of"), ("x=cached", "not a layer id"), ("1=cached,1=resident", "twice")]:
        with pytest.raises(errors.ConfigError, match=why):
            parse_placement(bad)


def test_a_mixed_store_is_byte_exact_on_both_layers(tables):
    rng = np.random.default_rng(3)
    with TieredStore.open(tables.directory, dram_bytes=MIXED_DRAM) as store:
        assert store.mode == "mixed" and store.placement() == {FIRST: "resident", LAST: "cached"}
        assert [a.layer for a in store.arena().layers] == [FIRST]
        assert set(store.resident_views()) == {FIRST}
        for _ in range(3):
            for layer in TINY.layers:
                ids = rng.integers(0, TINY.rows(layer), size=(37, 5))
                np.testing.assert_array_equal(store.lookup(layer, ids), expected(tables, layer, ids))
        s = store.stats()
        assert (s["resident"], s["resident_layers"], s["cached_layers"]) == (0, 1, 1)
        assert s["rows_nvme"] > 0 and s["cache_slots"] > 0 and s["arena_bytes"] == ONE_LAYER
        assert store.warm_up(np.array([[FIRST, 5], [LAST, 6]])) == 1  # the resident layer needs no warm-up


def test_a_mixed_daemon_serves_both_layers_and_says_where_each_is(tables, tmp_path):
    extra = ["--placement", f"{FIRST}=resident,{LAST}=cached", "--metrics", "127.0.0.1:0"]
    rng = np.random.default_rng(4)
    with DaemonProcess(tables.directory, tmp_path, dram_bytes=str(MIXED_DRAM), extra=extra) as daemon:
        assert daemon.ready["mode"] == "mixed"
        assert daemon.ready["placement"] == {str(FIRST): "resident", str(LAST): "cached"}
        for address, kwargs in [(daemon.unix, {}), (daemon.grpc, {"token_file": daemon.token_file})]:
            with EngramClient.connect(address, **kwargs) as client:
                info = client.info()
                assert info["mode"] == "mixed" and info["placement"] == daemon.ready["placement"]
                for layer in TINY.layers:
                    ids = rng.integers(0, TINY.rows(layer), size=(64, 3))
                    np.testing.assert_array_equal(client.lookup(layer, ids), expected(tables, layer, ids))
        with EngramClient.connect(daemon.unix) as client:
            arena = client.arena
            assert arena is not None and [a.layer for a in arena.layers] == [FIRST]
            ids = rng.integers(0, TINY.rows(FIRST), size=100)
            out = np.empty((100, TINY.row_bytes), np.uint8)
            np.testing.assert_array_equal(arena.gather_into(FIRST, ids, out), expected(tables, FIRST, ids))
            stats = client.stats()
            assert stats["store_rows_nvme"] > 0 and stats["unix_native_requests"] > 0  # cached and native paths
        text = urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics", timeout=10).read().decode()
        assert re.search(rf'^engram_store_layer_resident{{layer="{FIRST}"}} 1\.0$', text, re.M)
        assert re.search(rf'^engram_store_layer_resident{{layer="{LAST}"}} 0\.0$', text, re.M)
        engine = EngramStoreTables.connect(daemon.unix)  # engines read the resident layer in place, fetch the other
        assert engine.placement == {FIRST: "resident", LAST: "cached"}
        ids = rng.integers(0, TINY.rows(LAST), size=300)
        weight, scales = engine.staged(LAST, ids)
        np.testing.assert_array_equal(np.concatenate([weight.view(torch.uint8).numpy(), scales.numpy()], 1),
                                      expected(tables, LAST, ids))
        with pytest.raises(errors.StorageError, match=f"layer {LAST} is cached"):
            engine.views(LAST)


def test_a_placement_that_cannot_fit_is_a_config_error_before_any_table_is_read(tables, tmp_path):
    config = DaemonConfig(tables=str(tables.directory), socket="", metrics="", dram_bytes=MIXED_DRAM,
                          placement=f"{FIRST}=resident,{LAST}=resident")
    with pytest.raises(errors.ConfigError, match=r"'placement'.*need \d+ bytes of DRAM"):
        preflight(config)
    with pytest.raises(errors.ConfigError, match="layer 9"):
        DaemonConfig(tables=str(tables.directory), placement="9=cache")
    toml = tmp_path / "c.toml"
    toml.write_text(f'tables = "{tables.directory}"\nplacement = {{ {LAST} = "cached" }}\n')
    from engram_store.daemon.config import load_config

    assert load_config(config_file=toml, environ={}).placement == f"{LAST}=cached"
    assert json.loads(json.dumps(parse_placement(f"{LAST}=cached"))) == {str(LAST): "cached"}


def test_the_prefetcher_gathers_resident_layers_and_looks_cached_ones_up(tables):
    """In process (LocalClient over a mixed TieredStore): layer 1 from the mapped arena, layer 3 through
    lookups, rows byte-exact over a churn of prefill and decode steps."""
    from test_gpu_client_daemon import churn

    from engram_store.client.local import LocalClient
    from gpu_client import EngramPrefetcher

    with LocalClient(TieredStore.open(tables.directory, dram_bytes=MIXED_DRAM)) as client:
        with EngramPrefetcher(client, max_tokens=128) as pf:
            assert pf.path == "resident-cpu+staged"
            assert pf.info()["placement"] == {FIRST: "resident", LAST: "lookup"}
            churn(pf, tables, seed=11, max_len=30)
