"""Manifests that lie: each one is refused by ``verify`` and by ``serve`` (exit 2), the message
naming the layer, the field and both values, while the honest table set they were copied from
still verifies and serves exact bytes.

Every lie keeps the files consistent with itself where it can (sizes, crc32, sha256), so only a
check against the spec (rows, row_bytes, layer ids, the compressed vocabulary) can catch it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess, daemon_command, expected, make_tables

from engram_store import errors
from engram_store.cli import main
from engram_store.client.client import EngramClient
from engram_store.format.layout import PageLayout
from engram_store.format.manifest import MANIFEST
from engram_store.format.tableset import TableSet
from engram_store.format.writer import write_file_atomic
from engram_store.models.tokens import MAP_FILE, TokenMap, write_token_map

TINY_VOCAB = 512  # the tiny spec's compressed_vocab
RAW_VOCAB = 700


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> Path:
    """The tiny table set with a token map (raw ids 0..699 onto 512 classes)."""
    directory = tmp_path_factory.mktemp("honest") / "tiny"
    make_tables(directory, seed=21).close()
    entry = write_token_map(TokenMap.from_array(np.arange(RAW_VOCAB) % TINY_VOCAB, TINY_VOCAB), None,
                            write=lambda name, data: write_file_atomic(directory / name, data))
    _edit(directory, lambda m: m | {"token_map": entry})
    return directory


def _edit(directory: Path, change) -> None:
    path = directory / MANIFEST
    path.write_text(json.dumps(change(json.loads(path.read_text())), indent=1))


def _layer(m: dict, layer: int) -> dict:
    return next(e for e in m["layers"] if e["layer"] == layer)


def _row_bytes_64(m: dict) -> dict:
    """row_bytes 64 instead of 66, rows raised so the file size still matches (64 rows per page)."""
    e = _layer(m, 1)
    pages = PageLayout(e["rows"], e["row_bytes"]).pages
    e.update(row_bytes=64, rows=pages * 64)
    assert PageLayout(e["rows"], 64).file_bytes == e["file_bytes"]
    return m


def _rows_padded(m: dict) -> dict:
    """rows = pages x rows-per-page: the zero padding of the last page served as rows."""
    e = _layer(m, 3)
    layout = PageLayout(e["rows"], e["row_bytes"])
    e["rows"] = layout.pages * layout.rows_per_page
    assert e["rows"] > layout.rows and PageLayout(e["rows"], e["row_bytes"]).file_bytes == e["file_bytes"]
    return m


def _duplicate_layer(m: dict) -> dict:
    m["layers"].append(dict(_layer(m, 3)))
    return m


def _no_sha256(m: dict) -> dict:
    del m["token_map"]["sha256"]
    return m


def _map_out_of_range(directory: Path):
    """A map holding compressed ids up to 599 (the vocab is 512) whose crc32 and sha256 are its own,
    and classes raised to match: only the spec can tell."""
    def change(m: dict) -> dict:
        ids = (np.arange(RAW_VOCAB) % 600).astype("<i4")
        (directory / MAP_FILE).write_bytes(ids.tobytes())
        m["token_map"] |= {"crc32": zlib.crc32(ids.tobytes()), "sha256": TokenMap.from_array(ids, 600).sha256,
                           "classes": 600}
        return m
    return change


def _map_values_only(directory: Path):
    """The same values out of range, ``classes`` left at 512: the values themselves are checked."""
    def change(m: dict) -> dict:
        ids = (np.arange(RAW_VOCAB) % 600).astype("<i4")
        (directory / MAP_FILE).write_bytes(ids.tobytes())
        m["token_map"] |= {"crc32": zlib.crc32(ids.tobytes()), "sha256": TokenMap.from_array(ids, 600).sha256}
        return m
    return change


def _crc_file_short(directory: Path):
    def change(m: dict) -> dict:
        path = directory / _layer(m, 3)["crc_file"]
        path.write_bytes(path.read_bytes()[:-4])
        return m
    return change


# name -> (how to lie, what the one message must say: layer, field, both values)
CASES = {
    "row_bytes 64": (lambda d: _row_bytes_64, r"layer 1: field 'row_bytes' is 64, the spec's rows are 66"),
    "rows padded": (lambda d: _rows_padded, r"layer 3: field 'rows' is \d+, the spec's hash tables hold 13416"),
    "duplicate layer": (lambda d: _duplicate_layer, r"layer 3: listed 2 times \(field 'layer' must be unique\)"),
    "token map sha256 missing": (lambda d: _no_sha256, r"token map: field 'sha256' must be str, got None"),
    "token map classes": (_map_out_of_range, r"token map: field 'classes' is 600, the spec's compressed_vocab is 512"),
    "token map values": (_map_values_only, r"token map values span \[0, 599\], they must lie in \[0, 512\)"),
    "checksum file short": (_crc_file_short, r"layer 3 checksum file has \d+ bytes, \d+ pages need \d+"),
}


@pytest.fixture(scope="module")
def liars(honest, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("liars")
    out = {}
    for i, (name, (lie, _)) in enumerate(CASES.items()):
        d = root / f"case{i}"
        shutil.copytree(honest, d)
        _edit(d, lie(d))
        out[name] = d
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_verify_refuses_each_lie_naming_the_field(liars, name, capsys):
    with pytest.raises(errors.TableFormatError, match=CASES[name][1]):
        TableSet.open(liars[name])
    capsys.readouterr()
    assert main(["verify", str(liars[name])]) == 2
    err = capsys.readouterr().err
    assert re.search(CASES[name][1], err) and err.count("\n") == 1, err


def test_serve_refuses_each_lie_before_reading_a_table_byte(liars, honest, tmp_path):
    procs = {}
    for i, name in enumerate(CASES):
        args = daemon_command() + ["serve", "--tables", str(liars[name]), "--socket", str(tmp_path / f"{i}.sock"),
                                   "--grpc", "", "--metrics", "", "--log-level", "WARNING", "--dram-bytes", "1MiB"]
        procs[name] = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env={"PATH": "/usr/bin:/bin"})
    try:
        results = {name: (p.wait(60), p.communicate()[1]) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:  # a daemon that started serving a lie: the test has failed, stop it
                p.kill()
                p.wait()
    for name, (code, stderr) in results.items():
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2 and "Traceback" not in stderr, (name, code, stderr)
        assert len(lines) == 1 and re.search(CASES[name][1], lines[0]), (name, stderr)
    # the honest set they were copied from verifies and serves exact bytes (cached: 1 MiB of DRAM)
    assert main(["verify", str(honest)]) == 0
    ts = TableSet.open(honest)
    with DaemonProcess(honest, tmp_path, dram_bytes="1MiB") as d:
        assert d.ready["mode"] == "cached"
        client = EngramClient.connect(d.unix)
        try:
            ids = np.random.default_rng(0).integers(0, ts.rows(3), 2000)
            np.testing.assert_array_equal(client.lookup(3, ids), expected(ts, 3, ids))
        finally:
            client.close()
