"""`engram-store status` and `stats` against real daemons: every transport, one naming scheme, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, make_tables
from support.storage_helpers import flip

from engram_store.client.client import EngramClient
from engram_store.client.engine_fit import engine_fit
from engram_store.models.spec import get_spec
from engram_store.wire.metric_names import (
    FAMILIES,
    NOT_EXPORTED,
    family_of,
    prometheus_samples,
)

ROOT = Path(__file__).resolve().parents[1]
SPEC = get_spec("tiny")


def cli(*args: str, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "engram_store", *args], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    if check_rc is not None:
        assert res.returncode == check_rc, res.stdout + res.stderr
    return res


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    make_tables(d)
    return d


def _lookups(address: str, token_file: str | None = None, n: int = 3) -> None:
    with EngramClient.connect(address, token_file=token_file) as c:
        for layer in SPEC.layers:
            for _ in range(n):
                c.lookup(layer, np.arange(16, dtype=np.int64))


def test_status_of_a_mixed_daemon_over_unix_grpc_and_metrics(tables, tmp_path):
    first, second = SPEC.layers
    with DaemonProcess(tables, tmp_path, extra=["--placement", f"{first}=resident,{second}=cached"]) as d:
        _lookups(d.unix)
        docs = {"unix": json.loads(cli("status", d.unix, "--json").stdout),
                "grpc": json.loads(cli("status", d.grpc, "--json", "--token-file", d.token_file).stdout),
                "http": json.loads(cli("status", f"http://{d.ready['metrics']}", "--json").stdout)}
        human = cli("status", d.unix).stdout
    for name, doc in docs.items():
        assert doc["mode"] == "mixed", name
        assert [(e["layer"], e["placement"]) for e in doc["layers"]] == [(first, "resident"), (second, "cached")], name
        assert [e["rows"] for e in doc["layers"]] == [SPEC.rows(first), SPEC.rows(second)], name
        assert [e["bytes"] for e in doc["layers"]] == [SPEC.rows(x) * SPEC.row_bytes for x in SPEC.layers], name
        assert doc["version"] == d.ready["version"] and doc["uptime_seconds"] > 0, name
        assert doc["huge_pages"] in ("none", "thp", "hugetlb") and doc["arena_bytes"] > 0, name
        assert doc["cache_bytes"] > 0 and doc["bad_pages"] == {} and doc["layers_unavailable"] == {}, name
        assert doc["lookups"] == 2 * 3 and 0 <= doc["hit_ratio"] <= 1, name
        fit = doc["engines"]
        assert fit["usable"] and fit["in_place"] == [first] and fit["fetched"] == [second], name
    assert docs["unix"]["pid"] == d.ready["pid"]
    for name in ("unix", "grpc"):  # the model, from Info's spec; the metrics page does not carry it
        assert docs[name]["model"] == {"name": "tiny", "family": "DeepSeek-V4.1 Engram",
                                       "row_format": "FP8 E4M3 + E8M0 scale per 32 values",
                                       "row_bytes": SPEC.row_bytes, "rows_per_token": SPEC.rows_per_token}, name
    assert docs["http"]["model"] is None and "model       tiny (DeepSeek-V4.1 Engram)" in human
    from engram_store.native.pagesizes import format_page, read_page_sizes

    page, sizes = docs["unix"]["huge_page_bytes"], read_page_sizes()  # the arena's page: the kernel's, or a huge one
    assert page in {sizes.page_bytes, sizes.thp_bytes, *(p.page_bytes for p in sizes.pools)}
    assert f"{docs['unix']['huge_pages']} ({format_page(page)} pages)" in human
    assert f"{first}  resident" in human and f"{second}  cached" in human and "engines" in human
    assert "through the daemon's fetch path" in human


@pytest.mark.parametrize("model, words", [
    ("qwen3.8-flash-next", "FP8 E4M3 + one FP32 table scale"), ("qwen3.8-flash-next-bf16", "BF16"),
    ("qwen3.8-flash-next-nvfp4", "NVFP4 (E2M1) + E4M3 scale per 16 values + one FP32 table scale")])
def test_status_names_a_qwen_table_set(model, words, tmp_path):
    from engram_store.tools.synth import write_synthetic

    spec = get_spec(model, 0.0002)
    write_synthetic(tmp_path / "t", spec, seed=1)
    with DaemonProcess(tmp_path / "t", tmp_path) as d:
        doc = json.loads(cli("status", d.unix, "--json").stdout)
        human = cli("status", d.unix).stdout
    fmt = spec.row_format
    assert doc["model"] == {"name": model, "family": "Qwen4Exp PLE n-gram", "row_format": words,
                            "row_bytes": fmt.payload_bytes + fmt.scale_count, "rows_per_token": 16}
    assert doc["model"]["row_bytes"] == {"qwen3.8-flash-next": 160, "qwen3.8-flash-next-bf16": 320,
                                         "qwen3.8-flash-next-nvfp4": 90}[model]
    assert f"{model} (Qwen4Exp PLE n-gram): {words}, {doc['model']['row_bytes']} B a row, 16 rows a token" in human
    assert [e["layer"] for e in doc["layers"]] == [1]


def test_status_names_bad_pages_and_exits_1(tmp_path):
    tables = tmp_path / "tables"
    make_tables(tables)
    layer = SPEC.layers[0]
    flip(tables, layer, 2)
    (tmp_path / "run").mkdir()
    with DaemonProcess(tables, tmp_path / "run", extra=["--store-mode", "resident"]) as d:
        res = cli("status", d.unix, check_rc=1)
        doc = json.loads(cli("status", d.unix, "--json", check_rc=1).stdout)
        via_metrics = json.loads(cli("status", f"http://{d.ready['metrics']}", "--json", check_rc=1).stdout)
    assert doc["bad_pages"] == {str(layer): {"pages": 1, "ranges": [[2, 3]]}}
    assert via_metrics["bad_pages"] == {str(layer): {"pages": 1, "ranges": None}}
    for d_ in (doc, via_metrics):
        assert not d_["engines"]["usable"] and "checksums" in d_["engines"]["problems"][0]
    assert f"layer {layer}: 1 page(s) [2, 3)" in res.stdout and "NOT usable" in res.stdout


def test_stats_one_naming_scheme_over_every_transport(tables, tmp_path):
    with DaemonProcess(tables, tmp_path) as d:
        _lookups(d.unix)
        unix = json.loads(cli("stats", d.unix, "--json").stdout)
        grpc = json.loads(cli("stats", d.grpc, "--json", "--token-file", d.token_file).stdout)
        http = json.loads(cli("stats", f"http://{d.ready['metrics']}", "--json").stdout)
        with EngramClient.connect(d.unix) as c:
            raw = c.stats()
        text = cli("stats", d.unix).stdout
    assert set(unix) == set(grpc)
    assert all(k.startswith("engram_store_") for k in unix)
    # what the Stats request carries is exported on /metrics under the same name (histogram sums included)
    assert set(unix) <= set(http), sorted(set(unix) - set(http))
    assert unix['engram_store_tier_rows_total{tier="dram"}'] == http['engram_store_tier_rows_total{tier="dram"}'] > 0
    # every key the daemon answers has a Prometheus name, or is declared derived
    unnamed = [k for k in raw if k not in NOT_EXPORTED and family_of(k) is None]
    assert unnamed == []
    assert "engram_store_lookups_total" in text and "store_rows_dram" not in text


def test_one_family_per_stats_key():
    keys = ["unix_requests", "unix_native_requests", "grpc_errors_unauthenticated", "unix_dropped_clients_idle",
            "store_rows_dram", "store_arena_huge_pages", "hit_ratio", "store_plan_rows", "store_plan_rows_dram"]
    for key in keys:
        assert sum(f.match(key) is not None for f in FAMILIES) == 1, key
    names = [f.sample for f in FAMILIES]
    assert len(names) == len(set(names))
    assert not any("store_store" in n or n.endswith("_total_total") for n in names)
    assert prometheus_samples({"store_arena_huge_pages": 1, "grpc_errors_unavailable": 2, "unix_errors": 2}) == {
        'engram_store_arena_huge_pages{kind="none"}': 0.0, 'engram_store_arena_huge_pages{kind="thp"}': 1.0,
        'engram_store_arena_huge_pages{kind="hugetlb"}': 0.0,
        'engram_store_request_errors_total{code="unavailable",transport="grpc"}': 2.0}


@pytest.mark.parametrize("address", ["http://127.0.0.1:1", "unix:///nonexistent/engram.sock", "grpc://127.0.0.1:1"])
@pytest.mark.parametrize("command", ["stats", "status"])
def test_unreachable_daemon_is_one_line(command, address):
    res = cli(command, address, check_rc=2)
    assert res.stdout == "" and "Traceback" not in res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith(f"engram-store {command}: error:"), res.stderr


def test_info_of_an_address_points_to_status():
    res = cli("info", "unix:///run/engram-store/engram-store.sock", check_rc=2)
    assert "engram-store status unix:///run/engram-store/engram-store.sock" in res.stderr


def test_version_everywhere():
    from engram_store.version import __version__

    assert cli("--version").stdout.strip() == f"engram-store {__version__}"
    res = subprocess.run([sys.executable, "-m", "engram_store.daemon", "--version"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert res.returncode == 0 and __version__ in res.stdout


def test_engine_fit_rules():
    fit = engine_fit({"placement": {"1": "resident", "14": "cached"}, "arena": {"huge_pages": "hugetlb"}})
    assert fit.usable and fit.in_place == (1,) and fit.fetched == (14,) and len(fit.warnings) == 1
    fit = engine_fit({"placement": {"1": "resident"}, "arena": {"huge_pages": "none"}})
    assert fit.usable and "4 KiB pages" in fit.warnings[0]
    fit = engine_fit({"placement": {"1": "resident", "14": "resident"}, "layers_unavailable": {"14": "missing"},
                      "bad_pages": {"1": [[3, 5]]}})
    assert not fit.usable and fit.in_place == (1,) and len(fit.problems) == 2
    assert "layer 14 is unavailable" in fit.problems[0] and "2 page(s)" in fit.problems[1]
    assert not engine_fit({}).usable
