"""Where synth and import may write: --force replaces a table set and nothing else, the input is
never the output, a killed writer's leftovers are removed by the next run, striped replaces keep
the old set whole until the swap."""

import os
import subprocess
import sys

import numpy as np
import pytest
from support.interrupt import kill_mid_write
from test_import import make_checkpoint

from engram_store import TableSet, get_spec
from engram_store.errors import TableFormatError
from engram_store.format import owned, target, writer
from engram_store.tools.synth import synth_rows, write_synthetic

TINY = get_spec("tiny")


def listing(directory):
    return sorted(p.name for p in directory.iterdir())


def cli(*args):
    """``engram-store ARGS`` in a process of its own: (exit code, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "engram_store", *map(str, args)], capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, proc.stderr


def test_import_over_its_own_checkpoint_is_refused_with_force(tmp_path):
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt)
    (ckpt / "README.txt").write_text("mine")
    before = listing(ckpt)
    for out in (ckpt, ckpt / "tables"):
        code, err = cli("import", ckpt, "--model", "tiny", "--out", out, "--force")
        assert code == 2 and "the input" in err, err
        assert listing(ckpt) == before
    assert (ckpt / "README.txt").read_text() == "mine"


@pytest.mark.parametrize("force", [False, True])
def test_synth_over_a_directory_of_other_files_is_refused(tmp_path, force):
    out = tmp_path / "data"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "model.safetensors").write_bytes(b"x" * 100)
    code, err = cli("synth", "--model", "tiny", "--out", out, *(["--force"] if force else []))
    assert code == 2, err
    assert "is not a table set" in err and "model.safetensors, notes.txt" in err and "--force" not in err.split(";")[0]
    assert listing(out) == ["model.safetensors", "notes.txt"]
    assert listing(tmp_path) == ["data"]


def test_a_table_set_with_a_foreign_file_is_not_replaced(tmp_path):
    out = tmp_path / "ts"
    write_synthetic(out, TINY, seed=1)
    (out / "README.txt").write_text("mine")
    with pytest.raises(TableFormatError, match="also files that are not part of it: README.txt"):
        write_synthetic(out, TINY, seed=2, overwrite=True)
    assert TableSet.open(out).manifest.source["seed"] == 1 and (out / "README.txt").exists()


def test_empty_directory_and_table_set_are_written(tmp_path):
    out = tmp_path / "ts"
    out.mkdir()
    write_synthetic(out, TINY, seed=1)  # an empty directory needs no --force
    held = os.open(out / "layer_001.bin", os.O_RDONLY)  # a reader of the old set (a running daemon)
    try:
        write_synthetic(out, TINY, seed=2, overwrite=True)
        old = os.pread(held, 66, 0)
        assert np.array_equal(np.frombuffer(old, np.uint8), synth_rows(TINY, 1, 1, [0])[0])  # still the old bytes
    finally:
        os.close(held)
    ts = TableSet.open(out)
    assert ts.manifest.source["seed"] == 2
    assert np.array_equal(ts.read_rows(1, [0, 7]), synth_rows(TINY, 2, 1, [0, 7]))
    assert listing(tmp_path) == ["ts"]


def test_killed_synth_leftover_is_removed_by_the_next_synth_before_the_space_check(tmp_path, monkeypatch):
    out = tmp_path / "big"
    proc = subprocess.Popen([sys.executable, "-m", "engram_store", "synth", "--model", "deepseek-v4.1-flash",
                             "--scale", "0.01", "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_mid_write(proc, tmp_path, ".big.tmp-", 4 << 20)
    (leftover,) = tmp_path.iterdir()
    seen = []
    real_free = writer.free_bytes

    def free_bytes(path):
        seen.append(leftover.exists())
        return real_free(path)

    monkeypatch.setattr(writer, "free_bytes", free_bytes)
    write_synthetic(out, TINY, seed=3)
    assert seen and not any(seen), "the leftover still counted against the free-space check"
    assert listing(tmp_path) == ["big"]


def test_a_live_writers_temp_directory_is_left_alone(tmp_path):
    out = tmp_path / "ts"
    live = tmp_path / f"{target.temp_prefix(out)}999-live"
    dead = tmp_path / f"{target.temp_prefix(out)}998-dead"
    for d in (live, dead):
        d.mkdir()
        owned.Mark.create(d, out)  # as the writer marks the temp directory it makes
        (d / "layer_001.bin").write_bytes(b"\0" * 4096)
    mark_bytes = (dead / owned.MARK).stat().st_size
    fd = target.lock(live)
    try:
        assert target.remove_stale(out) == 4096 + mark_bytes
    finally:
        os.close(fd)
    assert live.exists() and not dead.exists()


def test_striped_replace_keeps_the_old_set_whole_and_removes_its_stripes_after(tmp_path):
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for d in dirs:
        d.mkdir()
    out = tmp_path / "ts"
    for seed in (1, 2, 3):
        write_synthetic(out, TINY, seed=seed, overwrite=True, stripe_dirs=dirs)
        ts = TableSet.open(out)
        assert np.array_equal(ts.read_rows(3, [0, 11, 600]), synth_rows(TINY, seed, 3, [0, 11, 600]))
        named = {os.path.basename(s.file) for e in ts.manifest.layers for s in e.stripes}
        assert {p.name for d in dirs for p in d.iterdir()} == named  # nothing of the replaced set is left
        assert ts.verify() == []
