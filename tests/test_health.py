"""The HTTP probes and the ready file, on real daemon processes and real HTTP.

/livez answers from the first moment, /readyz is 503 until the tables are loaded and every
listener is open (held there by a gate in the store opener, no sleeps), metrics live only under
/metrics, any other path is 404; the ready file is removed at stop, and one left by a killed
daemon is recognised as stale by its pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.daemon_helpers import REPO, DaemonProcess, make_tables, reaped, wait_ready_file
from engram_store.client import EngramClient
from engram_store.daemon import readyfile
from engram_store.daemon.http.metrics import MetricsServer


def _get(url: str, method: str = "GET") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=5)


@pytest.fixture(scope="module")
def daemon(tables, tmp_path_factory):
    with DaemonProcess(tables.directory, tmp_path_factory.mktemp("daemon")) as d:
        yield d


def test_probes_answer_and_other_paths_are_404(daemon):
    base = f"http://{daemon.ready['metrics']}"
    for path in ("/livez", "/readyz", "/healthz"):
        assert _get(base + path) == (200, "ok\n"), path
    for path in ("/", "/metrics/", "/metricsx", "/readyz/x", "/favicon.ico", "/LIVEZ", "/metrics.txt"):
        status, body = _get(base + path)
        assert status == 404 and "engram_store" not in body, (path, status, body[:200])
    status, _ = _get(base + "/readyz", method="HEAD")
    assert status == 200


def test_metrics_parse_and_count_a_lookup(daemon, tables):
    with EngramClient.connect(daemon.unix) as c:
        c.lookup(1, [0, 1, 2])
    # The daemon counts a lookup just after its reply is sent (the native path returns to Python
    # once the client has its rows), so a scrape right after the reply may not have it yet: poll.
    deadline = time.monotonic() + 10
    while True:
        status, text = _get(f"http://{daemon.ready['metrics']}/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        rows = {s.labels.get("transport"): s.value for s in families["engram_store_rows"].samples
                if s.name == "engram_store_rows_total"}
        if rows.get("unix", 0) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.01)  # polling the counter, bounded by the deadline
    assert rows.get("unix", 0) >= 3, rows


_GATED = textwrap.dedent("""
    # A real daemon whose store opener waits for a line on stdin: the test holds it in the fill.
    import sys
    from engram_store.daemon import service
    from engram_store.daemon.config import load_config

    config = load_config({"tables": sys.argv[1], "socket": sys.argv[2], "metrics": "127.0.0.1:0",
                          "ready_file": sys.argv[3], "dram_bytes": "1GiB", "log_level": "WARNING"}, environ={})
    daemon = None

    def gate(cfg):
        print(daemon.metrics.address, flush=True)
        sys.stdin.readline()
        return service.open_store(cfg)

    daemon = service.Daemon(config, store_opener=gate)
    import asyncio
    sys.exit(asyncio.run(daemon.run()))
""")


def test_readyz_is_503_until_the_tables_are_loaded(tables, tmp_path):
    script = tmp_path / "gated.py"
    script.write_text(_GATED)
    ready_file = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")}
    proc = subprocess.Popen([sys.executable, str(script), str(tables.directory), str(tmp_path / "s.sock"),
                             str(ready_file)], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    with reaped(proc):
        address = proc.stdout.readline().strip()  # printed by the gate: the store is not open yet
        assert address, "the gated daemon exited before opening its store"
        base = f"http://{address}"
        assert _get(base + "/livez") == (200, "ok\n")
        for path in ("/readyz", "/healthz"):
            status, body = _get(base + path)
            assert status == 503 and body.startswith("starting"), (path, status, body)
        assert not ready_file.exists()
        status, text = _get(base + "/metrics")  # no collector yet: an empty, valid page
        assert status == 200 and not list(text_string_to_metric_families(text))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        info = wait_ready_file(proc, ready_file, lambda: "daemon exited while loading")
        assert info["metrics"] == address and info["pid"] == proc.pid
        assert _get(base + "/readyz") == (200, "ok\n")  # ready before the file is written
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not ready_file.exists()


def test_readyz_says_stopping_while_draining():
    server = MetricsServer("127.0.0.1:0")
    address = server.start()
    try:
        assert _get(f"http://{address}/readyz")[0] == 503
        server.set_state("ready")
        assert _get(f"http://{address}/healthz") == (200, "ok\n")
        server.set_state("stopping")
        status, body = _get(f"http://{address}/readyz")
        assert status == 503 and body.startswith("stopping")
        assert _get(f"http://{address}/livez")[0] == 200
        with pytest.raises(ValueError):
            server.set_state("bogus")
    finally:
        server.stop()


def test_ready_file_removed_at_stop_and_stale_after_sigkill(tables, tmp_path):
    d = DaemonProcess(tables.directory, tmp_path)
    try:
        d.start()
        assert readyfile.read_live(str(d.ready_file))["pid"] == d.pid
        assert d.terminate() == 0
        assert not d.ready_file.exists()
        d.start()
        first = d.pid
        d.kill()
        assert d.ready_file.exists()  # SIGKILL leaves it behind ...
        assert readyfile.read_live(str(d.ready_file)) is None  # ... but no live daemon stands behind it
        d.start()  # the next daemon replaces the stale file
        assert d.ready["pid"] == d.pid != first
        assert readyfile.read_live(str(d.ready_file))["pid"] == d.pid
    finally:
        d.stop()


def test_second_daemon_refuses_a_live_daemons_ready_file(daemon, tables, tmp_path):
    before = daemon.ready_file.read_text()
    socket_path = tmp_path / "second.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")}
    result = subprocess.run([sys.executable, "-m", "engram_store.daemon", "serve", "--tables", str(tables.directory),
                             "--socket", str(socket_path), "--metrics", "127.0.0.1:0",
                             "--ready-file", str(daemon.ready_file)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"pid {daemon.pid}" in result.stderr and "ready_file" in result.stderr, result.stderr
    assert daemon.ready_file.read_text() == before  # untouched
    assert not socket_path.exists()  # refused before opening anything
