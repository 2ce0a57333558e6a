"""Checkpoint import: round trip on a generated multi-shard checkpoint, and every bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from support.interrupt import kill_mid_write

from engram_store import TableSet, get_spec
from engram_store.errors import CheckpointImportError, TableFormatError
from engram_store.tools.importer import import_checkpoint

TINY = get_spec("tiny")


def make_checkpoint(path, spec=TINY, *, prefix="model.", seed=0, drop=None, rows_delta=0, scale_dtype=torch.float8_e8m0fnu,
                    config=None):
    """Write a checkpoint of random FP8 tables split over shards (one per layer plus a shard of other
    weights); returns the expected ``payload || scales`` rows per layer."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    expected = {}
    fmt = spec.row_format
    for i, layer in enumerate(spec.layers):
        n = spec.rows(layer)
        w = rng.integers(0, 256, (n, fmt.dim), dtype=np.uint8)
        s = rng.integers(100, 150, (n + rows_delta, fmt.scale_count), dtype=np.uint8)
        expected[layer] = np.concatenate([w, s[:n]], axis=1)
        tensors = {
            f"{prefix}layers.{layer}.engram.embed.weight": torch.from_numpy(w).view(torch.float8_e4m3fn),
            f"{prefix}layers.{layer}.engram.embed.scale": torch.from_numpy(s).view(scale_dtype)
            if scale_dtype != torch.float32 else torch.from_numpy(s.astype(np.float32)),
            f"{prefix}layers.{layer}.mlp.weight": torch.zeros(4, 4),
        }
        if drop:
            tensors.pop(drop.format(layer=layer, prefix=prefix), None)
        save_file(tensors, str(path / f"model-{i:05d}-of-{len(spec.layers):05d}.safetensors"))
    save_file({"embed.weight": torch.ones(3, 3)}, str(path / "model-extra.safetensors"))
    (path / "config.json").write_text(json.dumps(config or {"engram_layer_ids": list(spec.layers), "engram_max_ngram_size": 4}))
    return expected


def test_round_trip_every_row(tmp_path):
    expected = make_checkpoint(tmp_path / "ckpt")
    import_checkpoint(tmp_path / "ckpt", tmp_path / "out", TINY, block_rows=700)
    ts = TableSet.open(tmp_path / "out")
    assert ts.verify() == []
    for layer in TINY.layers:
        assert np.array_equal(ts.read_rows(layer, np.arange(TINY.rows(layer))), expected[layer])


def test_names_without_model_prefix(tmp_path):
    expected = make_checkpoint(tmp_path / "ckpt", prefix="")
    import_checkpoint(tmp_path / "ckpt", tmp_path / "out", TINY)
    assert np.array_equal(TableSet.open(tmp_path / "out").read_rows(3, [5, 6]), expected[3][[5, 6]])


@pytest.mark.parametrize("kwargs,match", [
    ({"drop": "{prefix}layers.{layer}.engram.embed.scale"}, r"layers\.1\.engram\.embed\.scale not found"),
    ({"rows_delta": 3}, r"expected \[12458, 2\] to match"),
    ({"scale_dtype": torch.float32}, "has dtype F32"),
    ({"config": {"engram_layer_ids": [1, 2]}}, "engram_layer_ids"),
])
def test_bad_checkpoints_stop_and_leave_no_output(tmp_path, kwargs, match):
    make_checkpoint(tmp_path / "ckpt", **kwargs)
    with pytest.raises(CheckpointImportError, match=match):
        import_checkpoint(tmp_path / "ckpt", tmp_path / "out", TINY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_truncated_shard_is_named(tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "model-00001-of-00002.safetensors"
    os.truncate(shard, os.path.getsize(shard) - 100)
    with pytest.raises(CheckpointImportError, match="model-00001-of-00002.safetensors.*truncated"):
        import_checkpoint(tmp_path / "ckpt", tmp_path / "out", TINY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_wrong_model_for_checkpoint_is_refused(tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointImportError, match="shape"):
        import_checkpoint(tmp_path / "ckpt", tmp_path / "out", get_spec("tiny", scale=0.5))


def test_cli_import_killed_half_way_leaves_nothing(tmp_path):
    spec = get_spec("deepseek-v4.1-flash", scale=0.002)  # ~200 MB of tables
    make_checkpoint(tmp_path / "ckpt", spec, config={})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from engram_store.cli import main; "
                             "import engram_store.models.spec as s; s.MODELS['x'] = s.get_spec('deepseek-v4.1-flash', 0.002); "
                             "sys.exit(main(sys.argv[1:]))", "import", str(tmp_path / "ckpt"), "--model", "x", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_mid_write(proc, tmp_path, ".out.tmp-", 8 << 20)
    with pytest.raises(TableFormatError):
        TableSet.open(out)
    for p in tmp_path.iterdir():
        if p.name != "ckpt":
            with pytest.raises(TableFormatError, match="no manifest"):
                TableSet.open(p)
