"""Smoke-run the SGLang TP-step benchmark at tiny size and check its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sglang_tp_step_bench_quick(tmp_path):
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "sglang_tp_step.py"), "--quick", "--scale", "0.0001",
                             "--workdir", str(tmp_path), "--json", str(out)], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, ENGRAM_STORE_FETCH_HEDGE_SECONDS="2",
                                                  ENGRAM_STORE_FETCH_DEADLINE_SECONDS="2"))  # every step asks the daemon
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["mode"]: r for r in doc["results"] if r["tp"] == 2}
    split, every = rows["per-rank columns"], rows["every head"]
    assert split["wrong_rows"] == 0 and every["wrong_rows"] == 0
    assert split["daemon_rows_per_step"]["median"] == doc["batch"] * 24  # each row once, all ranks together
    assert every["daemon_rows_per_step"]["median"] == 2 * doc["batch"] * 24  # once per rank
    assert 0 < split["step_p50"]["median"] <= split["step_p99"]["median"]
    assert rows["step check flag (gloo all-reduce)"]["flag"]["p50_us"] > 0
    assert "per-rank columns" in result.stdout and "gloo" in result.stdout
