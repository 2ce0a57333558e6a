"""bench/nvme_throughput.py's crc32c part: the implementation in use, its GB/s against the C tables,
and (with valgrind) the instructions each path executes per 4 KiB page."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from engram_store.format import checksums

ROOT = Path(__file__).resolve().parents[1]


def test_crc32c_only_reports_the_implementation_its_rate_and_instructions(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "nvme_throughput.py"), "--crc32c-only", "--quick",
                          "--crc32c-instructions", "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    rates = out["crc32c_rates"]
    assert out["crc32c"] == rates["implementation"] == checksums.implementation()
    assert out["crc32c_gbps"] == rates["gbps"] > 0 and rates["table_gbps"] > 0
    assert rates["speedup_min"] <= rates["speedup_median"] <= rates["speedup_max"]
    assert f"crc32c ({out['crc32c']}" in res.stderr  # the table, on stderr under --json
    ins = out["crc32c_instructions"]
    if shutil.which("valgrind") is None or checksums.implementation() == "numpy":
        assert ins is None
        return
    assert ins["tables_per_page"] > 4096  # slicing by 8: several instructions per 8 bytes
    if out["crc32c"] in ("sse4.2", "armv8-crc32"):  # one instruction per 8 bytes, four chains
        assert ins["in_use_per_page"] < ins["tables_per_page"] / 4 and ins["ratio"] < 0.25
    else:  # the same C tables both times
        assert abs(ins["ratio"] - 1) < 0.05
