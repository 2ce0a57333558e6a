"""Smoke-run the import benchmark at tiny size and check its JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_bench_json(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "import_throughput.py"), "--model", "tiny", "--scale", "1",
                          "--reps", "1", "--dir", str(tmp_path), "--json"], check=True, capture_output=True, text=True).stdout
    doc = json.loads(out)
    assert doc["table_bytes"] > 0 and doc["copy_mb_s"] > 0 and doc["import_mb_s"] > 0
    assert doc["import_over_copy"] == round(doc["import_mb_s"] / doc["copy_mb_s"], 3) or abs(
        doc["import_over_copy"] - doc["import_mb_s"] / doc["copy_mb_s"]) < 0.01
    assert list(tmp_path.iterdir()) == []  # the bench cleans up after itself
