"""Smoke-run the fetch-faults benchmark at tiny size (this tree only, 4 node jobs) and check its JSON."""

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
    single = {"undisturbed", "flapping", "stopped"}
    node = {"node-undisturbed", "node-slow", "node-slow-unbounded"}
    assert set(rows) == single | node and {r["client"] for r in doc["results"]} == {"this tree"}
    for summary in rows.values():
        assert summary["wrong_steps"] == 0, summary
        assert 0 < summary["p50"]["median"] <= summary["p99"]["median"] <= summary["max"]["median"]
    for name in single:
        assert rows[name]["counters"]["failed_steps"] == 0, rows[name]
    assert rows["stopped"]["counters"]["direct_steps"] == doc["steps"]  # a stopped daemon: every step read directly
    for name in node:  # every job's steps, each served by one path; direct pages in flight within the budget
        s = rows[name]
        counters = s["counters"]
        assert counters["steps"] == [doc["node_jobs"] * doc["steps"]], s
        served = sum(counters[k][0] for k in ("daemon_steps", "hedged_direct_steps", "fallback_direct_steps",
                                              "failed_steps"))
        assert served == counters["steps"][0] and counters["waited_steps"][0] <= counters["daemon_steps"][0], s
        assert 0 <= s["in_flight_max"][0] <= s["budget_pages"][0], s
    assert "p50" in result.stdout and "stopped" in result.stdout and "node-slow" in result.stdout
