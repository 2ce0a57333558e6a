"""Smoke runs of bench/e2e.py and bench/device_check.py at tiny size (CPU); their JSON is checked, not their speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ["--hidden", "64", "--mlp", "128", "--heads", "4"]


def run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    return json.loads(out.stdout)


def test_e2e_quick_json():
    doc = run("e2e.py", "--quick", "--json", "--device", "cpu", *TINY_MODEL)
    assert doc["logits_identical"] is True
    assert doc["paths"]["a"] == "resident-cpu" and doc["paths"]["b"] == "staged" and doc["paths"]["c"] == "staged"
    assert set(doc["results"]) == {"decode-64", "prefill"}
    for res in doc["results"].values():
        assert res["a"]["overhead_pct"] == 0.0
        for case in ("a", "b", "c"):
            assert res[case]["step_ms"] > 0 and res[case]["steps_timed"] > 0


def test_e2e_help():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--json" in out and "--quick" in out


def test_device_check_cpu_only():
    doc = run("device_check.py", "--cpu-only", "--json")
    status = {r["check"]: r["status"] for r in doc["rows"]}
    assert status["hash"] == "ok"
    prefetch = [c for c in status if c.startswith("prefetch ")]
    assert len(prefetch) == 5 and all(status[c] == "ok" for c in prefetch)
    assert status["h2d"] == "skipped" and status["kvikio"] == "skipped"
    assert status["e2e logits identical"] == "ok"
    assert status["raw-ids map"] == "ok"
    assert not [r for r in doc["rows"] if r["status"] == "FAIL"]
