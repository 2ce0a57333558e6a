"""Table format: layout rule, synthetic rows, reference reader, verify, atomic publish."""

import os
import subprocess
import sys

import numpy as np
import pytest
from support.interrupt import kill_mid_write

from engram_store import TableSet, get_spec
from engram_store.errors import RowOutOfRange, TableFormatError, UnknownLayer
from engram_store.format.layout import PageLayout
from engram_store.format.manifest import Manifest
from engram_store.tools.synth import synth_rows, write_synthetic

TINY = get_spec("tiny")


@pytest.fixture(scope="module")
def tiny_tables(tmp_path_factory):
    out = tmp_path_factory.mktemp("t") / "tiny"
    write_synthetic(out, TINY, seed=11, block_rows=620)  # several blocks per layer
    return out


def test_no_row_straddles_a_page():
    for row_bytes in (66, 264, 1000, 4096):
        layout = PageLayout(rows=10_000, row_bytes=row_bytes)
        start = layout.byte_offset(np.arange(10_000))
        assert ((start % 4096) + row_bytes <= 4096).all()
        assert layout.file_bytes % 4096 == 0 and start[-1] + row_bytes <= layout.file_bytes


def test_reader_matches_synthetic_rows(tiny_tables):
    ts = TableSet.open(tiny_tables)
    assert ts.layers == TINY.layers and ts.row_bytes == 66
    for layer in TINY.layers:
        n = TINY.rows(layer)
        assert ts.rows(layer) == n
        assert os.path.getsize(ts.path(layer)) % 4096 == 0
        ids = np.r_[0, n - 1, np.random.default_rng(layer).integers(0, n, 500)]
        assert np.array_equal(ts.read_rows(layer, ids), synth_rows(TINY, 11, layer, ids))
    # Synthetic rows depend on the seed and the layer, and payload holds no FP8 NaN codes.
    a = synth_rows(TINY, 11, 1, np.arange(50))
    assert not np.array_equal(a, synth_rows(TINY, 12, 1, np.arange(50)))
    assert not np.array_equal(a, synth_rows(TINY, 11, 3, np.arange(50)))
    assert not ((a[:, :64] & 0x7F) == 0x7F).any()


def test_reader_rejects_bad_requests(tiny_tables):
    ts = TableSet.open(tiny_tables)
    with pytest.raises(UnknownLayer):
        ts.read_rows(2, [0])
    with pytest.raises(RowOutOfRange):
        ts.read_rows(1, [TINY.rows(1)])
    with pytest.raises(RowOutOfRange):
        ts.read_rows(1, [-1])


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "engram_store", *map(str, args)], capture_output=True, text=True)


def test_info_and_verify_catch_a_flipped_byte(tmp_path):
    out = tmp_path / "tables"
    assert run_cli("synth", "--model", "tiny", "--seed", "2", "--out", out).returncode == 0
    info = __import__("json").loads(run_cli("info", out).stdout)
    assert info["rows"] == TINY.rows(1) + TINY.rows(3) and info["row_bytes"] == 66
    assert run_cli("verify", out).returncode == 0
    path = out / Manifest.load(out).layer(3).file
    middle = os.path.getsize(path) // 2 + 7
    with open(path, "r+b") as f:
        f.seek(middle)
        b = f.read(1)
        f.seek(middle)
        f.write(bytes([b[0] ^ 0x10]))
    res = run_cli("verify", out)
    assert res.returncode == 1
    page = middle // 4096
    assert f"layer 3: page {page} (bytes {page * 4096}..{page * 4096 + 4095}" in res.stderr, res.stderr


def test_truncated_or_foreign_tables_do_not_open(tmp_path, tiny_tables):
    with pytest.raises(TableFormatError, match="not a table set"):
        TableSet.open(tmp_path)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_tables, copy)
    path = copy / Manifest.load(copy).layer(1).file
    os.truncate(path, os.path.getsize(path) - 4096)
    with pytest.raises(TableFormatError, match="truncated"):
        TableSet.open(copy)


def test_existing_output_is_kept_unless_forced(tmp_path, tiny_tables):
    with pytest.raises(TableFormatError, match="already holds a table set; pass --force"):
        write_synthetic(tiny_tables, TINY, seed=0)
    out = tmp_path / "x"
    write_synthetic(out, TINY, seed=1)
    write_synthetic(out, TINY, seed=2, overwrite=True)
    assert TableSet.open(out).manifest.source["seed"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_killed_synth_leaves_nothing_that_opens(tmp_path):
    out = tmp_path / "big"
    proc = subprocess.Popen([sys.executable, "-m", "engram_store", "synth", "--model", "deepseek-v4.1-flash",
                             "--scale", "0.01", "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_mid_write(proc, tmp_path, ".big.tmp-", 4 << 20)
    assert not out.exists()
    with pytest.raises(TableFormatError):
        TableSet.open(out)
    (leftover,) = [p for p in tmp_path.iterdir()]
    with pytest.raises(TableFormatError, match="no manifest"):
        TableSet.open(leftover)
