"""Qwen4Exp (Qwen3.8-Flash-Next) table sets: the table's one global scale, and checkpoint import.

The scale (vLLM's per-tensor FP8 ``weight_scale``, NVFP4's ``weight_scale_2``) lives in the
manifest's ``table_scales`` and, as float32 bits, in its layer's checksum file header: a
manifest whose scale was changed is refused by ``verify`` and ``serve``, naming the field and
both values. The daemon's Info carries it over the Unix socket and gRPC.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess, daemon_command

from engram_store import errors
from engram_store.cli import main
from engram_store.client.client import EngramClient
from engram_store.format.manifest import MANIFEST
from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec
from engram_store.tools.synth import TABLE_SCALE_STEP, synth_rows, write_synthetic

SCALE = 0.00005  # prime base 1,000: 16 heads of ~1,000 rows, padded to 16,896 rows
FP8, BF16, NVFP4 = "qwen3.8-flash-next", "qwen3.8-flash-next-bf16", "qwen3.8-flash-next-nvfp4"
ULP_UP = float(np.nextafter(np.float32(TABLE_SCALE_STEP), np.float32(1)))  # the synthetic scale, one float32 step up


@pytest.fixture(scope="module")
def synth_sets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen-synth")
    out = {}
    for name in (FP8, BF16, NVFP4):
        write_synthetic(root / name, get_spec(name, SCALE), seed=5)
        out[name] = root / name
    return out


def _edit(directory: Path, change) -> None:
    path = directory / MANIFEST
    path.write_text(json.dumps(change(json.loads(path.read_text())), indent=1))


def test_synth_stores_a_table_scale_exactly_where_the_rows_have_one(synth_sets, tmp_path, capsys):
    for name, want in ((FP8, TABLE_SCALE_STEP), (NVFP4, TABLE_SCALE_STEP), (BF16, None)):
        ts = TableSet.open(synth_sets[name])
        assert ts.table_scale(1) == want and ts.manifest.table_scales == ({} if want is None else {1: want})
        raw = json.loads((synth_sets[name] / MANIFEST).read_text())
        assert ("table_scales" in raw) == (want is not None)
        np.testing.assert_array_equal(ts.read_rows(1, np.arange(0, ts.rows(1), 97)),
                                      synth_rows(ts.spec, 5, 1, np.arange(0, ts.rows(1), 97)))
        assert main(["verify", str(synth_sets[name])]) == 0
    assert TABLE_SCALE_STEP != 1.0 and float(np.float32(TABLE_SCALE_STEP)) == TABLE_SCALE_STEP
    args = ["synth", "--model", FP8, "--scale", str(SCALE), "--out", str(tmp_path / "s")]
    assert main(args + ["--table-scale", "0.375"]) == 0
    assert TableSet.open(tmp_path / "s").table_scale(1) == 0.375
    capsys.readouterr()
    assert main(args + ["--table-scale", "0.1", "--force"]) == 2  # not a float32 value
    assert "not a float32 value" in capsys.readouterr().err
    assert main(["synth", "--model", BF16, "--scale", str(SCALE), "--out", str(tmp_path / "b"),
                 "--table-scale", "0.5"]) == 2
    assert "has no table scale" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def _set_scale(value):
    def change(m: dict) -> dict:
        m["table_scales"] = {"1": value}
        return m
    return change


def _drop_scales(m: dict) -> dict:
    del m["table_scales"]
    return m


# name -> (model, manifest edit, what the one message must say)
LIES = {
    "scale changed": (FP8, _set_scale(0.5), r"layer 1: field 'table_scales' is 0.5, its checksum file was "
                                            r"written with 0.013671875"),
    "nvfp4 scale one ulp up": (NVFP4, _set_scale(ULP_UP), rf"field 'table_scales' is {ULP_UP!r}, its checksum "
                                                          r"file was written with 0.013671875"),
    "scale not float32": (FP8, _set_scale(0.1), r"layer 1: field 'table_scales' is 0.1, not a float32 value"),
    "scale negative": (FP8, _set_scale(-0.013671875), r"layer 1: field 'table_scales' is -0.013671875, a table "
                                                      r"scale must be finite and > 0"),
    "scale missing": (FP8, _drop_scales, r"layer 1: field 'table_scales' has no scale for it"),
    "scale on bf16": (BF16, _set_scale(0.5), r"layer 1: field 'table_scales' gives 0.5, the spec's rows "
                                             r"\(bfloat16\) have no table scale"),
}


@pytest.fixture(scope="module")
def liars(synth_sets, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen-liars")
    out = {}
    for i, (name, (model, lie, _)) in enumerate(LIES.items()):
        d = root / f"case{i}"
        shutil.copytree(synth_sets[model], d)
        _edit(d, lie)
        out[name] = d
    return out


@pytest.mark.parametrize("name", list(LIES))
def test_verify_refuses_a_manifest_whose_table_scale_lies(liars, name, capsys):
    with pytest.raises(errors.TableFormatError, match=LIES[name][2]):
        TableSet.open(liars[name])
    capsys.readouterr()
    assert main(["verify", str(liars[name])]) == 2
    err = capsys.readouterr().err
    assert re.search(LIES[name][2], err) and err.count("\n") == 1, err


def test_serve_refuses_a_changed_table_scale(liars, tmp_path):
    args = daemon_command() + ["serve", "--tables", str(liars["scale changed"]), "--socket", str(tmp_path / "d.sock"),
                               "--grpc", "", "--metrics", "", "--log-level", "WARNING", "--dram-bytes", "1MiB"]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(LIES["scale changed"][2], proc.stderr), proc.stderr


def test_info_carries_the_table_scales_over_unix_and_grpc(synth_sets, tmp_path):
    for name, want in ((FP8, {"1": TABLE_SCALE_STEP}), (BF16, None)):
        (tmp_path / name).mkdir()
        with DaemonProcess(synth_sets[name], tmp_path / name, dram_bytes="1MiB") as d:
            clients = [EngramClient.connect(d.unix), EngramClient.connect(d.grpc, token_file=d.token_file)]
            try:
                for client in clients:
                    info = client.info()
                    assert info.get("table_scales") == want and ("table_scales" in info) == (want is not None)
            finally:
                for client in clients:
                    client.close()
