"""Smoke-run the import benchmark at tiny size and check its JSON."""

import json
import subprocess
import sys
from pathlib import Path

from engram_store.models.spec import get_spec

ROOT = Path(__file__).resolve().parents[1]


def test_import_bench_json(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "import_throughput.py"), "--model", "tiny", "--scale", "1",
                          "--reps", "1", "--dir", str(tmp_path), "--json"], check=True, capture_output=True, text=True).stdout
    doc = json.loads(out)
    spec = get_spec("tiny")
    # the bytes it timed are the model's tables (computed here, not by the bench) ...
    assert doc["table_bytes"] == sum(spec.rows(layer) * spec.row_bytes for layer in spec.layers)
    # ... the import it timed produced the checkpoint's rows (the bench compares them with TableSet.read_rows) ...
    assert doc["verified_rows"] >= 1000
    # ... and every timed repetition is in the figures
    assert len(doc["copy_seconds"]) == len(doc["import_seconds"]) == 1 and min(doc["import_seconds"]) > 0
    assert list(tmp_path.iterdir()) == []  # the bench cleans up after itself
