"""bench/hint_load.py runs: a smoke run of seconds (one round, 'later' 1 s after the flood), its table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_bench_runs(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "hint_load.py"), "--quick", "--json",
                          str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "miss share" in res.stdout and "p99 flood/quiet" in res.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    for phase in ("quiet", "flood", "ended", "later"):
        got = report["rounds"][0][phase]
        assert got["lookups"] > 0 and 0 <= got["miss_share"] <= 1
    assert report["rounds"][0]["flooder"]["sent"] > 0


def test_help():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "hint_load.py"), "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0 and "--after" in res.stdout
