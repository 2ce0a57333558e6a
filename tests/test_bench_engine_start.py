"""Smoke-run the engine-start benchmark at tiny size and check its JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_engine_start_bench_quick(tmp_path):
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_start.py"), "--quick", "--workdir", str(tmp_path),
                             "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["table_bytes"] > 0 and len(doc["pss_checkpoint"]["per_process_bytes"]) == doc["processes"] == 2
    for way in ("checkpoint_cold", "daemon"):
        assert doc[way]["ready_seconds"]["median"] > 0
    assert doc["ratio_ready_checkpoint_over_daemon"] == doc["checkpoint_cold"]["ready_seconds"]["median"] / \
        doc["daemon"]["ready_seconds"]["median"]
    assert "ready: checkpoint / daemon" in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # the bench removes its checkpoint and tables
