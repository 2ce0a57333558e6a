"""Every bench takes the same flags: --help, --quick and --json [PATH] ('-' or none: stdout carries JSON only)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(p for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_") and p.name != "cachesim.py")
sys.path.insert(0, str(ROOT / "bench"))

from _common import JsonReport, add_report_args  # noqa: E402


def test_every_bench_is_found():
    assert {"lookup.py", "lookup_daemon.py", "traffic.py", "import_throughput.py", "device_check.py"} <= {
        p.name for p in BENCHES}


@pytest.mark.parametrize("bench", BENCHES, ids=lambda p: p.name)
def test_help_names_the_common_flags(bench):
    res = subprocess.run([sys.executable, str(bench), "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--quick" in res.stdout and "--json [PATH]" in res.stdout, res.stdout


def _parse(argv):
    import argparse

    ap = argparse.ArgumentParser()
    add_report_args(ap, "smoke")
    return ap.parse_args(argv)


def test_json_flag_forms():
    assert _parse([]).json is None
    assert _parse(["--json"]).json == "-"
    assert _parse(["--json", "-"]).json == "-"
    assert _parse(["--json", "out.json", "--quick"]).json == "out.json"


CHILD = """
import subprocess, sys
sys.path.insert(0, {bench!r})
from _common import JsonReport, add_report_args
import argparse
ap = argparse.ArgumentParser()
add_report_args(ap, "smoke")
args = ap.parse_args(sys.argv[1:])
with JsonReport(args) as report:
    print("progress from python")
    subprocess.run(["echo", "progress from a child process"], check=True)
    report.emit({{"answer": 42}}, lambda: print("the human table"))
"""


def _run_child(*argv):
    code = CHILD.format(bench=str(ROOT / "bench"))
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)


def test_json_dash_keeps_stdout_for_the_json_only():
    res = _run_child("--json", "-")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"answer": 42}  # nothing else on stdout, not even the child's echo
    for line in ("progress from python", "progress from a child process", "the human table"):
        assert line in res.stderr


def test_json_path_writes_the_file_and_prints_the_table(tmp_path):
    out = tmp_path / "r.json"
    res = _run_child("--json", str(out))
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text()) == {"answer": 42}
    assert "the human table" in res.stdout and "{" not in res.stdout


def test_no_json_prints_the_table_only():
    res = _run_child()
    assert "the human table" in res.stdout and "answer" not in res.stdout + res.stderr


def test_a_failed_run_writes_no_json(tmp_path):
    args = _parse(["--json", str(tmp_path / "r.json")])
    with pytest.raises(RuntimeError):
        with JsonReport(args) as report:
            report.emit({"partial": True})
            raise RuntimeError("the bench failed")
    assert not (tmp_path / "r.json").exists()


def test_gather_micro_quick_json_dash():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gather_micro.py"), "--quick", "--json", "-"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["results"] and "variant" in res.stderr  # the table went to stderr
