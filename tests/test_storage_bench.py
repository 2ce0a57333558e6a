"""Smoke runs of the storage benches at tiny size: they start, finish and print valid JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_bench(script: str, *args: str, cwd: Path) -> dict:
    res = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                         timeout=300, cwd=cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def test_nvme_throughput_quick_json(tmp_path):
    out = run_bench("nvme_throughput.py", "--quick", "--json", "--workdir", str(tmp_path), cwd=tmp_path)
    assert [p["qd"] for p in out["points"]] == [1, 16]
    for p in out["points"]:
        assert p["ours_iops"] > 0 and p["lookup_rows_per_s"] > 0 and p["direct"] is True
        if out["fio"]:
            assert p["fio_iops"] > 0 and p["ratio_iops"] == pytest.approx(p["ours_iops"] / p["fio_iops"], rel=1e-2)
    assert out["sequential_gbps"] > 0


def test_lookup_quick_json(tmp_path):
    out = run_bench("lookup.py", "--quick", "--json", "--workdir", str(tmp_path), "--modes", "resident", "cached-10",
                    "--traffic", "uniform", "zipf1.0", cwd=tmp_path)
    points = {(p["mode"], p["traffic"], p["size"]): p for p in out["results"]}
    assert len(points) == 8
    for p in points.values():
        assert p["store"]["rows_per_s"] > 0 and p["torch"]["rows_per_s"] > 0 and p["store_vs_torch"] > 0
        assert p["store"]["p99_ms"] >= p["store"]["p50_ms"]
        assert 0.0 <= p["store"]["hit_rate"] <= 1.0  # counts timed requests only
        if p["mode"] == "resident":
            assert p["store"]["hit_rate"] == 1.0
    rates = {h["traffic"]: h for h in out["hit_rates"]}
    assert set(rates) == {"uniform", "zipf1.0"}
    for h in rates.values():  # Belady is the optimum for the same slots: nothing may beat it
        assert h["slots"] > 0 and h["accesses"] > 0 and h["cache_percent"] == 10
        assert 0 <= h["lru_exact"] <= h["belady"] <= 1
        assert 0 <= h["s3fifo"] <= h["belady"] and 0 <= h["lru"] <= h["belady"]


def test_benches_have_help():
    for script in ("nvme_throughput.py", "lookup.py"):
        res = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], capture_output=True, text=True)
        assert res.returncode == 0 and "--json" in res.stdout


def load_lookup_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_lookup", ROOT / "bench" / "lookup.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def test_offline_references_on_a_known_trace():
    bench = load_lookup_bench()
    keys = np.array([1, 2, 3, 1, 2, 3, 1, 2, 3], dtype=np.int64)
    assert bench.lru_hits(keys, 2, 0) == 0  # a cyclic scan one larger than the cache defeats LRU
    assert bench.lru_hits(keys, 3, 0) == 6
    # MIN keeps 1 and 2, bypasses 3: hits at positions 3, 4, then keeps the soonest needed
    assert bench.belady_hits(keys, 2, 0) == 4
    assert bench.belady_hits(keys, 3, 0) == 6
    assert bench.belady_hits(keys, 2, 5) == 2  # only positions >= 5 count
