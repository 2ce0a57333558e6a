"""Smoke-run the fetch-faults benchmark at tiny size (this tree only) and check its JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fetch_faults_bench_quick(tmp_path):
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "fetch_faults.py"), "--quick", "--scale", "0.0001",
                             "--workdir", str(tmp_path), "--json", str(out)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["scenario"]: r["summary"] for r in doc["results"]}
    assert set(rows) == {"undisturbed", "flapping", "stopped"} and {r["client"] for r in doc["results"]} == {"this tree"}
    for summary in rows.values():
        assert summary["wrong_steps"] == 0 and summary["counters"]["failed_steps"] == 0, summary
        assert 0 < summary["p50"]["median"] <= summary["p99"]["median"] <= summary["max"]["median"]
    assert rows["stopped"]["counters"]["direct_steps"] == doc["steps"]  # a stopped daemon: every step read directly
    assert "p50" in result.stdout and "stopped" in result.stdout
