"""Smoke run of bench/lookup_daemon.py at tiny size: it runs, prints its table and writes JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_help_and_quick_run(tmp_path):
    bench = str(ROOT / "bench" / "lookup_daemon.py")
    out = subprocess.run([sys.executable, bench, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--quick" in out.stdout
    report = tmp_path / "r.json"
    # Standalone: the bench makes its own gRPC token file (gRPC needs client authentication),
    # so nothing of ENGRAM_STORE_* (e.g. a token file) may come from the caller's environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")}
    out = subprocess.run([sys.executable, bench, "--quick", "--sizes", "decode", "--clients", "1",
                          "--backends", "inproc,unix-view,unix-arena,grpc", "--json", str(report)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "unix-view" in out.stdout and "vs inproc" in out.stdout
    rows = json.loads(report.read_text())["results"]
    assert {r["backend"] for r in rows} == {"inproc", "unix-view", "unix-arena", "grpc"}
    assert all(r["rows_per_s"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in rows)
