"""Smoke runs of bench/e2e.py and bench/device_check.py at tiny size (CPU); their JSON is checked, not their speed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _device_cached import MEMORY_FS, STEPS  # noqa: E402
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


def test_device_check_cpu_only(tmp_path):
    doc = run("device_check.py", "--cpu-only", "--json", "--workdir", str(tmp_path))
    status = {r["check"]: r["status"] for r in doc["rows"]}
    notes = {r["check"]: r["note"] for r in doc["rows"]}
    assert status["hash"] == "ok"
    prefetch = [c for c in status if c.startswith("prefetch ")]
    assert len(prefetch) == 5 and all(status[c] == "ok" for c in prefetch)
    assert status["h2d"] == "skipped" and status["kvikio"] == "skipped"
    assert status["e2e logits identical"] == "ok"
    assert status["raw-ids map"] == "ok"
    assert not [r for r in doc["rows"] if r["status"] == "FAIL"]
    # the cached-chain checks' host path: the same logic with threads for streams (bench/_device_cached.py)
    steps = STEPS["host"]
    assert status["cached-chain vllm"] == status["cached-chain sglang"] == "skipped"
    assert status["cached-chain numpy"] == "ok" and f"{steps['graph']} steps" in notes["cached-chain numpy"]
    assert status["cached-chain nodes numpy"] == "skipped"  # no CUDA graphs to count
    assert status["cached-chain main-stream"] == "ok" and "rows exact: True" in notes["cached-chain main-stream"]
    assert status["cached-chain two-jobs one-stream"] == status["cached-chain two-jobs two-streams"] == "ok"
    killed = notes["cached-chain daemon-killed"]
    assert status["cached-chain daemon-killed"] == "ok" and "SIGKILLed (exit -9)" in killed
    assert f"read directly {steps['killed']}, from the daemon 0, failed 0" in killed and "rows exact: True" in killed
    pages = int(re.search(r"(\d+) pages read and checked", killed).group(1))
    assert pages > 0
    # the disk row names the filesystem util-linux names for the workdir, and the pages the job read there
    if shutil.which("findmnt"):
        fstype = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(tmp_path)], capture_output=True,
                                text=True, check=True).stdout.strip()
        disk = next(r for r in doc["rows"] if r["check"] == "cached-chain disk")
        assert disk["value"].startswith(f"{fstype} on "), disk
        assert disk["status"] == ("skipped" if fstype in MEMORY_FS else "ok"), disk
        assert str(tmp_path) in disk["note"] and f"{pages} pages read from it" in disk["note"]
    assert not list(tmp_path.iterdir())  # the scratch directory is removed
