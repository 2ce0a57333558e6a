"""Smoke-run the one-copy benchmark at tiny size and check its JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_one_copy_bench_quick(tmp_path):
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "one_copy.py"), "--quick", "--json", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {(r["case"], r["rows"]) for r in doc["results"]} == {(c, n) for c in ("resident", "cached-hit", "python")
                                                                 for n in (1024 * 24, 64 * 24)}
    for r in doc["results"]:
        assert r["wrong_steps"] == 0, r
        one, two = r["counters"]["one copy"], r["counters"]["two copies"]
        assert one["copied_rows"] == 0 and one["one_copy_steps"] == one["daemon_steps"] > 0, r
        assert two["one_copy_steps"] == 0 and two["copied_rows"] == two["daemon_steps"] * r["rows"], r
        assert one["direct_steps"] == two["direct_steps"] == 0 and one["failed_steps"] == 0, r
        assert 0 < r["ms"]["one copy"]["median"] and r["ratio_two_over_one"]["n"] == doc["repeats"]
        assert r["case"] == "resident" or r["nvme_rows_while_measured"] == 0, r  # cached cases: every row a hit
    assert "two/one" in result.stdout and "all exact" in result.stdout
