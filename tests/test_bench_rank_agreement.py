"""Smoke-run the rank-agreement benchmark (two gloo ranks, 50 steps a mode) and check its JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rank_agreement_bench_quick(tmp_path):
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "rank_agreement.py"), "--quick", "--json", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["mode"]: r for r in doc["modes"]}
    assert {m: r["surveyed"] for m, r in rows.items()} == {"barrier": "-", "board": "BOARD", "agree": "AGREE"}
    for r in rows.values():
        assert r["steps"] == 45 and 0 < r["p50_us"] <= r["p99_us"] <= r["max_us"], r
