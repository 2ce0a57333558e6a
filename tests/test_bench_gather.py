"""bench/gather_micro.py runs, checks every variant's rows against the table, and reports each against its baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gather_micro_quick():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gather_micro.py"), "--quick", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr  # a variant whose rows differ from the table exits non-zero
    doc = json.loads(out.stdout)
    results = doc["results"]
    assert {"split", "interleaved-memfd", "torch"} <= set(results)
    assert results[doc["baseline"]]["speed_vs_baseline"] == 1.0
    for r in results.values():
        assert r["rows_per_s"] > 0 and r["us_min"] <= r["us_per_request"] <= r["us_max"]
