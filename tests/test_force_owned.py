"""``--force`` removes only regular files the writer wrote, inside the target or the run's --stripe-dir
directories: each hostile or careless variant below is refused (or left alone) with every user file
byte-identical, and the table sets involved still read their exact rows."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engram_store import TableSet, get_spec
from engram_store.errors import TableFormatError
from engram_store.format import owned
from engram_store.format.manifest import MANIFEST
from engram_store.tools.synth import synth_rows, write_synthetic

TINY = get_spec("tiny")
IDS = np.array([0, 11, 600, 5])


def snapshot(*roots: Path) -> dict[str, tuple[str, str]]:
    """Every path under ``roots`` (hidden ones too): its kind and the sha256 of a file's bytes."""
    seen = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames:
                seen[os.path.join(dirpath, name)] = ("dir", "")
            for name in filenames:
                path = os.path.join(dirpath, name)
                seen[path] = ("file", hashlib.sha256(Path(path).read_bytes()).hexdigest())
    return seen


def user_files(directory: Path, n: int = 4) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n):
        f = directory / f"precious_{i}.bin"
        f.write_bytes(os.urandom(4096 * (i + 1)))
        files.append(f)
    return files


def exact(out: Path, seed: int) -> None:
    """An honest reader of ``out`` gets the synthetic rows of ``seed`` and every page checks."""
    ts = TableSet.open(out)
    try:
        assert ts.verify() == []
        for layer in TINY.layers:
            assert np.array_equal(ts.read_rows(layer, IDS), synth_rows(TINY, seed, layer, IDS))
    finally:
        ts.close()


def cli(*args):
    proc = subprocess.run([sys.executable, "-m", "engram_store", *map(str, args)], capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, proc.stderr


@pytest.fixture
def striped(tmp_path):
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for d in dirs:
        d.mkdir()
    out = tmp_path / "S"
    write_synthetic(out, TINY, seed=1, stripe_dirs=dirs)
    return out, dirs


def rewrite_stripes(out: Path, paths: list[str]) -> None:
    """Point the manifest's stripe entries at ``paths`` (in order, cycling)."""
    raw = json.loads((out / MANIFEST).read_text())
    k = 0
    for entry in raw["layers"]:
        for stripe in entry["stripes"]:
            stripe["file"] = paths[k % len(paths)]
            k += 1
    (out / MANIFEST).write_text(json.dumps(raw))


@pytest.mark.parametrize("form", ["absolute", "dotdot"])
def test_stripes_naming_user_files_are_refused_before_anything_is_touched(striped, tmp_path, form):
    out, dirs = striped
    victims = user_files(tmp_path / "home")
    paths = [str(v) if form == "absolute" else f"../home/{v.name}" for v in victims]
    rewrite_stripes(out, paths)
    before = snapshot(tmp_path)
    for stripe_dirs in (dirs, [tmp_path / "home", dirs[0]]):  # even with the victims' directory declared
        with pytest.raises(TableFormatError, match="refusing to replace .*nothing was touched"):
            write_synthetic(out, TINY, seed=2, overwrite=True, stripe_dirs=stripe_dirs)
    assert snapshot(tmp_path) == before


def test_a_copied_striped_set_is_not_replaced_and_the_original_still_verifies(striped, tmp_path):
    """``synth --stripe-dir N0 --stripe-dir N1 --out S; cp -r S C; synth --out C --force`` (and the same
    with C's stripe directories given): refused, S untouched and verifiable."""
    out, dirs = striped
    copy = tmp_path / "C"
    shutil.copytree(out, copy)
    before = snapshot(tmp_path)
    code, err = cli("synth", "--model", "tiny", "--seed", 3, "--out", copy, "--force")
    assert code == 2 and "refusing to replace" in err and "outside" in err, err
    with pytest.raises(TableFormatError, match="not a name engram-store gives C's stripes"):
        write_synthetic(copy, TINY, seed=3, overwrite=True, stripe_dirs=dirs)
    assert snapshot(tmp_path) == before
    exact(out, seed=1)
    exact(copy, seed=1)  # the copy reads S's stripes: still whole


def test_a_same_named_copy_elsewhere_does_not_take_the_originals_stripes(striped, tmp_path):
    out, dirs = striped
    other = tmp_path / "elsewhere" / "S"  # the same name, so the stripe names match the pattern
    shutil.copytree(out, other)
    before = snapshot(tmp_path)
    with pytest.raises(TableFormatError, match="not written as part of"):
        write_synthetic(other, TINY, seed=3, overwrite=True, stripe_dirs=dirs)
    assert snapshot(tmp_path) == before
    exact(out, seed=1)


def test_a_user_file_in_place_of_a_stripe_is_not_removed(striped, tmp_path):
    out, dirs = striped
    stripe = Path(TableSet.open(out).manifest.layers[0].stripes[0].file)
    stripe.unlink()
    stripe.write_bytes(b"a user's bytes under the stripe's name")
    before = snapshot(tmp_path)
    with pytest.raises(TableFormatError, match="does not name it"):
        write_synthetic(out, TINY, seed=2, overwrite=True, stripe_dirs=dirs)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("named", ["layer_001.bin", "userdir"])
def test_a_directory_named_as_a_layer_file_is_refused(tmp_path, named):
    out = tmp_path / "X"
    write_synthetic(out, TINY, seed=1)
    raw = json.loads((out / MANIFEST).read_text())
    entry = next(e for e in raw["layers"] if e["file"] == "layer_001.bin")
    (out / "layer_001.bin").unlink()  # the layer's file is now a directory of user files
    entry["file"] = named
    (out / MANIFEST).write_text(json.dumps(raw))
    user_files(out / named)
    before = snapshot(tmp_path)
    with pytest.raises(TableFormatError, match="refusing to replace"):
        write_synthetic(out, TINY, seed=2, overwrite=True)
    code, err = cli("synth", "--model", "tiny", "--out", out, "--force")
    assert code == 2 and f"{out / named} is a directory" in err, err
    assert snapshot(tmp_path) == before


def test_a_manifest_naming_a_file_engram_store_does_not_write_is_refused(tmp_path):
    out = tmp_path / "X"
    write_synthetic(out, TINY, seed=1)
    raw = json.loads((out / MANIFEST).read_text())
    raw["token_map"] = {"file": "thesis.tex"}
    (out / MANIFEST).write_text(json.dumps(raw))
    (out / "thesis.tex").write_text("three years of work")
    before = snapshot(tmp_path)
    with pytest.raises(TableFormatError, match="'thesis.tex', not a file name engram-store writes"):
        write_synthetic(out, TINY, seed=2, overwrite=True)
    assert snapshot(tmp_path) == before


def test_user_directories_named_like_leftovers_are_never_removed(tmp_path):
    out = tmp_path / "X"
    write_synthetic(out, TINY, seed=1)
    old, temp = tmp_path / ".X.old-1234", tmp_path / ".X.tmp-999-mine"
    user_files(old)
    user_files(temp)
    (temp / "layer_001.bin").write_bytes(b"named like a table file")  # a name the writer uses, still the user's
    copied = tmp_path / ".X.tmp-42-copied"  # a copy of a writer's marked directory: not the writer's own
    copied.mkdir()
    (tmp_path / "marked").mkdir()
    owned.Mark.create(tmp_path / "marked", out)
    shutil.copy(tmp_path / "marked" / owned.MARK, copied / owned.MARK)
    (copied / "layer_002.bin").write_bytes(b"mine")
    before = snapshot(old, temp, copied)
    code, err = cli("synth", "--model", "tiny", "--seed", 2, "--out", out, "--force")
    assert code == 0, err
    assert snapshot(old, temp, copied) == before
    exact(out, seed=2)


def test_a_killed_writers_marked_leftovers_are_removed_and_nothing_else(striped, tmp_path):
    """A killed striped writer's temp directory (marked) and its temp stripes go; a user file beside
    them whose name follows the stripe temp pattern stays."""
    out, dirs = striped
    leftover = tmp_path / ".S.tmp-77-dead"
    leftover.mkdir()
    mark = owned.Mark.create(leftover, out)
    (leftover / "layer_001.crc").write_bytes(b"\0" * 100)
    temps = []
    for k, d in enumerate(dirs):
        final = d / f"S.layer_001.s{k}.zz9.bin"
        temp = d / f".{final.name}.tmp-77"
        temp.write_bytes(b"\0" * 4096)
        mark.add_stripe(temp, final, os.lstat(temp))
        temps.append(temp)
    lookalike = dirs[0] / ".S.layer_009.s0.bin.tmp-78"
    lookalike.write_bytes(b"a user's file")
    write_synthetic(out, TINY, seed=4, overwrite=True, stripe_dirs=dirs)
    assert not leftover.exists() and not any(t.exists() for t in temps)
    assert lookalike.read_bytes() == b"a user's file"
    exact(out, seed=4)
    named = {os.path.basename(s.file) for e in TableSet.open(out).manifest.layers for s in e.stripes}
    assert {p.name for d in dirs for p in d.iterdir()} == named | {lookalike.name}  # the replaced set's stripes went


def test_honest_replaces_still_work(striped, tmp_path):
    out, dirs = striped
    code, err = cli("synth", "--model", "tiny", "--seed", 5, "--out", out, "--force",
                    "--stripe-dir", dirs[0], "--stripe-dir", dirs[1])
    assert code == 0, err
    exact(out, seed=5)
    plain = tmp_path / "plain"
    write_synthetic(plain, TINY, seed=1)
    code, err = cli("synth", "--model", "tiny", "--seed", 6, "--out", plain, "--force")
    assert code == 0, err
    exact(plain, seed=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["S", "nvme0", "nvme1", "plain"]
