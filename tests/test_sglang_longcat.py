"""The SGLang plugin serving LongCat-Flash-Lite's n-gram tables: SGLang 0.5.23's own ``NgramEmbedding`` on CPU
(``.venv-sglang``, Triton's interpreter) with ``oe_embeder``'s rows the daemon's, resident and cached, against real
daemons. Each run is one process of ``tests/engines/sglang_longcat.py``, which compares SGLang's ids with
engram-store's hash (SGLang's EOS rule), ``oe_embeder``'s lookups with ``TableSet.read_rows`` and ``forward`` with
SGLang's own ``NgramEmbedding`` loaded from ``read_rows``, on one and two TP ranks; the cached run also checks the
prompt hints of a prefill SGLang's scheduler plans (the rows its later chunks fetch, read ahead and hit) and stops a
step reading a flipped page at ``Scheduler.process_batch_result``."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from support.daemon_helpers import REPO, DaemonProcess

from engram_store.format.layout import PAGE_BYTES
from engram_store.models.spec import get_spec
from engram_store.tools.synth import write_synthetic

SGLANG_PYTHON = Path(os.environ.get("ENGRAM_STORE_SGLANG_PYTHON", REPO / ".venv-sglang" / "bin" / "python"))
NAME = "longcat-flash-lite"
SCALE = 0.0005  # m = 5,112: 61,488 rows of 512 B (31 MB)
SCRIPT = REPO / "tests" / "engines" / "sglang_longcat.py"
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                 reason=f"{SGLANG_PYTHON} is absent (make engine-test builds .venv-sglang)")]


def scenario(*args: str, address: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "SGLANG_"))}
    env |= {"ENGRAM_STORE_ADDR": address, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
            "SGLANG_PLUGINS": "engram_store", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run([str(SGLANG_PYTHON), str(SCRIPT), *map(str, args)], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    return result.stdout


def check_common(out: str, where: str) -> None:
    assert re.search(rf"OK {where}: SGLang's ids of \d+ positions \(\d+ EOS", out), out
    for what in ("forward equals SGLang's own NgramEmbedding", "2 TP ranks own rows"):
        assert f"OK {where}: {what}" in out, out
    assert "mismatch named: rows of Engram layer 0" in out and "mismatch named: LongCat vocab_size" in out, out
    assert "OK refused: LongCat n-gram table with --enable-dp-attention" in out, out


def test_resident_table_read_in_place_by_sglangs_lookup(tmp_path):
    directory = tmp_path / "tables"
    write_synthetic(directory, get_spec(NAME, SCALE), seed=41)
    with DaemonProcess(directory, tmp_path, dram_bytes="1GiB") as d:
        assert d.ready["mode"] == "resident"
        out = scenario(directory, address=d.unix)
    check_common(out, "resident")


def test_cached_table_fetched_in_the_forward_and_a_failed_page_raised_before_the_results(tmp_path):
    from support.storage_helpers import flip

    directory, spec = tmp_path / "tables", get_spec(NAME, SCALE)
    write_synthetic(directory, spec, seed=42)
    page = spec.rows(0) // (PAGE_BYTES // spec.row_bytes) // 3
    with DaemonProcess(directory, tmp_path, dram_bytes="4MiB") as d:  # its hinted share above a prompt's rows
        assert d.ready["mode"] == "cached"
        flip(directory, 0, page)  # after the start: neither the daemon nor its cache has read it
        out = scenario(directory, page, address=d.unix)
    check_common(out, "cached")
    assert re.search(r"OK hints: \d+ rows of layers \[0\] .* withdrawn when it finished", out), out
    assert re.search(rf"OK CorruptRows at Scheduler.process_batch_result.*layer 0.*\b{page}\b", out), out
