"""The dashboard and the alert rules against a real Prometheus scraping a real daemon on loopback.

`promtool check rules` checks deploy/prometheus/alerts.yml, `promtool test rules` fires each
alert on synthetic series (tests/prometheus/alerts_test.yml); then a Prometheus server (Debian's
``prometheus`` package) scrapes a daemon every second and evaluates the rules every second:
every metric deploy/grafana/engram-store.json and the rules name must exist in it after lookups
over both transports, every rule must evaluate without error, and EngramStoreCorruptPages must
fire once a page read by a lookup fails its checksum. Without the package these tests skip,
naming it; `make prometheus-check` installs it and sets ENGRAM_STORE_REQUIRE_PROMETHEUS=1, under
which its absence fails instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, make_tables
from support.storage_helpers import flip

from engram_store.client.client import EngramClient
from engram_store.errors import CorruptRows, EngramStoreError
from engram_store.models.spec import get_spec

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "engram-store.json"
SPEC = get_spec("tiny")
DEADLINE = 60.0  # seconds for anything Prometheus does on a 1 s cycle (a loaded CI box)
_NAME = re.compile(r"\b((?:engram_store|process)_[a-z0-9_]+|up)\b(?!\s*\()")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        why = f"{name} not found: Debian's prometheus package is not installed (`make prometheus-check` installs it)"
        if os.environ.get("ENGRAM_STORE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return path


def exprs() -> dict[str, list[str]]:
    """Every PromQL expression of the dashboard and the rules, by where it is."""
    import yaml

    out: dict[str, list[str]] = {"dashboard": [], "rules": []}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        out["dashboard"] += [t["expr"] for t in panel.get("targets", [])]
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        out["rules"] += [rule["expr"] for rule in group["rules"]]
    return out


def metric_names() -> set[str]:
    names = set()
    for expr in sum(exprs().values(), []):
        expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
        expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
        names |= set(_NAME.findall(expr))
    return names


def test_promtool_checks_the_rules():
    res = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_promtool_checks_the_example_config():
    res = subprocess.run([tool("promtool"), "check", "config", "prometheus.yml"], capture_output=True, text=True,
                         timeout=60, cwd=RULES.parent)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_promtool_unit_tests_of_each_alert():
    """tests/prometheus/alerts_test.yml: every alert on synthetic series, firing and not."""
    res = subprocess.run([tool("promtool"), "test", "rules", "alerts_test.yml"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT / "tests" / "prometheus")
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_dashboard_names_what_the_issue_asks_for():
    text = " ".join(exprs()["dashboard"])
    for name in ("engram_store_requests_total", "engram_store_request_latency_seconds_bucket",
                 "engram_store_tier_rows_total", "engram_store_nvme_pages_read_total", "engram_store_nvme_read_bytes_total",
                 "engram_store_corrupt_pages_total", "engram_store_connected_clients", "process_resident_memory_bytes",
                 "engram_store_dram_bytes" if "engram_store_dram_bytes" in text else "engram_store_arena_bytes"):
        assert name in text, name
    alerts = {rule.get("alert") for group in __import__("yaml").safe_load(RULES.read_text())["groups"]
              for rule in group["rules"]}
    assert {"EngramStoreDown", "EngramStoreCorruptPages", "EngramStoreLayerUnavailable", "EngramStoreLatencyP99High",
            "EngramStoreHitRateCollapse", "EngramStoreClientsDropped"} <= alerts


class Prometheus:
    """A Prometheus server on 127.0.0.1:0; the address is read back from its log."""

    def __init__(self, workdir: Path, target: str) -> None:
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": "engram-store", "static_configs": [{"targets": [target]}]}]}
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.proc = subprocess.Popen([tool("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={workdir / 'data'}", "--web.listen-address=127.0.0.1:0",
                                      "--log.level=info"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.address = ""
        ready = threading.Event()

        def read() -> None:  # the log, line by line: the address, then readiness
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r'msg="Listening on" address=(\S+)', line)
                if m:
                    self.address = m.group(1)
                if "Server is ready to receive web requests" in line:
                    ready.set()
            ready.set()  # exited: start() says so

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(DEADLINE) or self.proc.poll() is not None or not self.address:
            self.stop()
            raise AssertionError("prometheus did not start:\n" + "".join(self.log[-30:]))

    def api(self, path: str, **params: str) -> dict:
        url = f"http://{self.address}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=10) as resp:
            doc = json.loads(resp.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def wait_for(self, what: str, check) -> object:
        """Poll ``check()`` (a query of data Prometheus gathers on its 1 s cycle) until it is truthy."""
        deadline = time.monotonic() + DEADLINE
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus: {what} not seen within {DEADLINE:.0f}s\n" + "".join(self.log[-20:]))
            time.sleep(0.2)  # polling Prometheus' next scrape or evaluation, not waiting blindly

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _firing(prom: Prometheus, name: str) -> list[dict]:
    return [a for a in prom.api("alerts")["alerts"] if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_real_prometheus_scrapes_the_daemon_and_the_corrupt_page_alert_fires(tmp_path):
    tool("promtool")
    tables = tmp_path / "tables"
    make_tables(tables)
    (tmp_path / "run").mkdir()
    (tmp_path / "prom").mkdir()
    layer = SPEC.layers[-1]
    rows_per_page = 4096 // SPEC.row_bytes
    with DaemonProcess(tables, tmp_path / "run", dram_bytes="256KiB",
                       extra=["--store-mode", "cached", "--scrub-bytes-per-second", "0"]) as daemon:
        prom = Prometheus(tmp_path / "prom", daemon.ready["metrics"])
        try:
            with EngramClient.connect(daemon.unix) as unix, \
                    EngramClient.connect(daemon.grpc, token_file=daemon.token_file) as grpc:
                for client in (unix, grpc):
                    for other in SPEC.layers:
                        client.lookup(other, np.arange(0, 64, dtype=np.int64))
                with pytest.raises(EngramStoreError):  # an error, so that the error counters have a series
                    unix.lookup(layer, np.array([SPEC.rows(layer)], dtype=np.int64))
                prom.wait_for("a scrape of the daemon after the lookups", lambda: prom.api(
                    "query", query='engram_store_requests_total{transport="grpc"} > 0')["result"])
                missing = prom.wait_for("every metric the dashboard and rules name", lambda: [
                    name for name in sorted(metric_names())
                    if not prom.api("query", query=f'count({{__name__="{name}"}})')["result"]] or ["none"])
                assert missing == ["none"], f"named by the dashboard or the rules but not exported: {missing}"
                prom.wait_for("the rules evaluated", lambda: all(
                    r.get("lastEvaluation", "").startswith("2") and not r["lastEvaluation"].startswith("0001")
                    for g in prom.api("rules")["groups"] for r in g["rules"]))
                unhealthy = [(r["name"], r.get("lastError")) for g in prom.api("rules")["groups"] for r in g["rules"]
                             if r["health"] != "ok"]
                assert unhealthy == []
                assert _firing(prom, "EngramStoreCorruptPages") == []

                page = 40  # a page the lookups above never read: its rows come from NVMe and fail there
                flip(tables, layer, page)
                with pytest.raises(CorruptRows):
                    unix.lookup(layer, np.arange(page * rows_per_page, page * rows_per_page + 3, dtype=np.int64))
            alerts = prom.wait_for("EngramStoreCorruptPages firing", lambda: _firing(prom, "EngramStoreCorruptPages"))
            assert alerts[0]["labels"]["instance"] == daemon.ready["metrics"]
            assert float(alerts[0]["value"]) == 1.0
            bad = prom.api("query", query=f'engram_store_bad_pages{{layer="{layer}"}}')["result"]
            assert [float(s["value"][1]) for s in bad] == [1.0]
            assert _firing(prom, "EngramStoreDown") == [] and _firing(prom, "EngramStoreLayerUnavailable") == []
        finally:
            prom.stop()
