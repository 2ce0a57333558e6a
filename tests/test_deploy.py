"""deploy/: the systemd unit verifies, the TOML documents exactly the config keys, the DaemonSet has its parts."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from engram_store.daemon.config import KEYS, DaemonConfig, load_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_default_toml_matches_config_exactly():
    raw = tomllib.loads((DEPLOY / "engram-store.toml").read_text())
    assert set(raw) == set(KEYS), set(raw) ^ set(KEYS)
    cfg = load_config(config_file=DEPLOY / "engram-store.toml", environ={})
    defaults = DaemonConfig()
    for key in KEYS:
        if key != "tables":  # the one key without a usable default
            assert getattr(cfg, key) == getattr(defaults, key), key


def test_every_toml_key_is_documented():
    lines = (DEPLOY / "engram-store.toml").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\w+) = ", line)
        if m and m.group(1) not in ("grpc_tls_key",):  # documented together with grpc_tls_cert
            assert lines[i - 1].startswith("#"), f"{m.group(1)} has no comment above it"


def test_unit_has_the_required_directives():
    text = (DEPLOY / "engram-store.service").read_text()
    for directive in ("Type=notify", "Restart=on-failure", "LimitMEMLOCK=infinity", "RuntimeDirectory=engram-store",
                      "ReadOnlyPaths=", "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes"):
        assert directive in text, directive


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    # verify checks that ExecStart exists: point it at an executable that does, nothing else changes
    unit = (DEPLOY / "engram-store.service").read_text().replace("/usr/local/bin/engram-store", sys.executable)
    path = tmp_path / "engram-store.service"
    path.write_text(unit)
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "engram-store.service" not in result.stderr, result.stderr  # no warning about our unit


def test_daemonset_has_tables_socket_and_huge_pages():
    text = (DEPLOY / "k8s-daemonset.yaml").read_text()
    assert "kind: DaemonSet" in text
    assert re.search(r"name: tables[^\n]*\n\s+hostPath: \{path: /var/lib/engram-store/tables", text)
    assert "mountPath: /tables, readOnly: true" in text
    assert re.search(r"name: run[^\n]*\n\s+hostPath: \{path: /run/engram-store", text)
    # memfds need a hugetlb allowance (the resource), neither a /dev/shm nor a hugetlbfs mount
    assert re.search(r"requests: \{[^}]*hugepages-2Mi: \d+Gi", text) and "/dev/shm" not in text.split("volumes:")[-1]
    assert "medium: HugePages-2Mi" not in text
    for env in re.findall(r"name: (ENGRAM_STORE_\w+)", text):  # every variable it sets is a real key
        assert env[len("ENGRAM_STORE_"):].lower() in KEYS, env
