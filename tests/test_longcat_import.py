"""LongCat-Flash-Lite n-gram tables: checkpoint import.

Checkpoints are written here in vLLM 0.33's tensor names (``model.ngram_embeddings.embedders.{e}.weight``, BF16
``[m + 2e + 1, oe_dim]``, dealt over several safetensors files with tensors the import must not read) with the
``safetensors`` package; every imported row is compared byte for byte with the checkpoint's through
``TableSet.read_rows``, in vLLM's concatenation order (table ``e`` at ``exclusive_sizes[e]``, from the
model's sizes). Refusals name the field or tensor, and leave nothing behind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from support.safetensors_files import write_shards
from support.storage_helpers import flip

from engram_store import errors
from engram_store.cli import main
from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec
from engram_store.tools.importer import import_checkpoint

NAME = "longcat-flash-lite"
SCALE = 0.0002  # m = 2,045: 12 tables of 2,046 .. 2,068 rows of 512 B (12.6 MB)
SPEC = get_spec(NAME, SCALE)
V, EOS = SPEC.compressed_vocab, SPEC.pad_id


def _config(spec, **override) -> dict:
    """A LongcatFlashConfig's n-gram fields for ``spec`` (the ratio exact in binary: vocab_size is a power of two)."""
    k, n = spec.heads, spec.max_ngram
    return {"architectures": ["LongcatFlashNgramForCausalLM"], "model_type": "longcat_flash",
            "vocab_size": spec.compressed_vocab, "hidden_size": spec.row_format.dim * k * (n - 1),
            "ngram_vocab_size_ratio": spec.table_base / spec.compressed_vocab, "emb_neighbor_num": n,
            "emb_split_num": k, "eos_token_id": spec.pad_id, "pad_token_id": 3, "torch_dtype": "bfloat16"} | override


def make_checkpoint(path: Path, spec, *, files: int = 3, seed: int = 0, config=None, edit=None) -> np.ndarray:
    """``spec``'s n-gram tables (random BF16 bit patterns) in vLLM's names over ``files`` files, with the
    projections, the word embedding and an MTP copy beside them; ``edit(tensors)`` changes them before writing.
    Returns the rows the import must give, ``[rows, 512]`` bytes: the tables concatenated at vLLM's offsets."""
    rng = np.random.default_rng(seed)
    sizes = spec.sizes(0).reshape(-1)
    tensors, expected = {}, np.zeros((spec.rows(0), spec.row_bytes), np.uint8)
    exclusive = np.concatenate([[0], np.cumsum(sizes)])  # vLLM's exclusive_sizes, from the sizes alone
    hidden = spec.row_format.dim * sizes.size
    for e, rows in enumerate(sizes.tolist()):
        table = rng.integers(0, 256, (rows, spec.row_bytes), dtype=np.uint8)
        expected[exclusive[e]:exclusive[e + 1]] = table
        tensors[f"model.ngram_embeddings.embedders.{e}.weight"] = torch.from_numpy(table).view(torch.bfloat16)
        tensors[f"model.ngram_embeddings.post_projs.{e}.weight"] = torch.zeros(hidden, spec.row_format.dim,
                                                                               dtype=torch.bfloat16)
    tensors["model.embed_tokens.weight"] = torch.ones(16, hidden, dtype=torch.bfloat16)
    tensors["model.mtp.ngram_embeddings.embedders.0.weight"] = torch.ones(4, spec.row_format.dim, dtype=torch.bfloat16)
    if edit:
        edit(tensors)
    write_shards(path, tensors, files)
    if config is not False:
        (path / "config.json").write_text(json.dumps(_config(spec) if config is None else config))
    return expected


def test_import_gives_the_checkpoints_rows_in_vllms_order(tmp_path):
    expected = make_checkpoint(tmp_path / "ckpt", SPEC, files=4)
    import_checkpoint(tmp_path / "ckpt", tmp_path / "out", SPEC, block_rows=3000)  # blocks cross tables and files
    ts = TableSet.open(tmp_path / "out")
    assert ts.spec == SPEC and ts.rows(0) == expected.shape[0] == 12 * SPEC.table_base + 144
    np.testing.assert_array_equal(ts.read_rows(0, np.arange(ts.rows(0))), expected)
    ids = np.random.default_rng(3).integers(0, ts.rows(0), 500)
    np.testing.assert_array_equal(ts.read_rows(0, ids), expected[ids])
    assert ts.table_scale(0) is None
    assert main(["verify", str(tmp_path / "out")]) == 0


def test_cli_import_takes_the_spec_from_config_and_verify_finds_a_flipped_byte(tmp_path, capsys):
    expected = make_checkpoint(tmp_path / "ckpt", SPEC, files=2, seed=4)
    assert main(["import", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    ts = TableSet.open(tmp_path / "out")
    spec = ts.spec
    assert spec.name == "longcat_flash" and spec.expected_rows is None
    for field in ("layers", "orders", "heads", "table_base", "compressed_vocab", "pad_id", "multipliers", "row_format",
                  "boundary", "hash_rule", "size_rule", "eos_current", "token_ids"):
        assert getattr(spec, field) == getattr(SPEC, field), field
    np.testing.assert_array_equal(ts.read_rows(0, np.arange(ts.rows(0))), expected)
    (tmp_path / "out" / ts.manifest.layer(0).file).chmod(0o640)
    flip(tmp_path / "out", 0, 7, at=300)
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "out")]) == 1
    assert re.search(r"CORRUPT layer 0: page 7 \(bytes 28672\.\.32767", capsys.readouterr().err)


def test_a_full_size_config_gives_the_built_in_model(tmp_path):
    from engram_store.tools.import_longcat import checkpoint_spec

    full = get_spec(NAME)
    (tmp_path / "config.json").write_text(json.dumps(_config(full) | {"ngram_vocab_size_ratio": 78}))
    assert checkpoint_spec(tmp_path) is full
    sglang = {k: v for k, v in _config(full).items() if k not in ("ngram_vocab_size_ratio", "emb_split_num")}
    (tmp_path / "config.json").write_text(json.dumps(sglang | {"oe_vocab_size_ratio": 78, "oe_split_num": 4}))
    assert checkpoint_spec(tmp_path) is full  # SGLang's aliases


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    def edit(t):
        t[name] = value(t[name])
    return edit


E = "model.ngram_embeddings.embedders."
# case -> (checkpoint options, what the one error must say)
REFUSALS = {
    "config ratio": ({"config": {"ngram_vocab_size_ratio": 0.5}}, r"ngram_vocab_size_ratio = 0\.5 \(gives m = 65536"),
    "config alias": ({"config": {"oe_split_num": 3}}, r"oe_split_num = 3 \(model .* has 4\)"),
    "config n": ({"config": {"emb_neighbor_num": 3}}, r"emb_neighbor_num = 3 \(model .* has 4\)"),
    "config vocab": ({"config": {"vocab_size": 131073}}, r"vocab_size = 131073 \(model .* has 131072\)"),
    "config hidden": ({"config": {"hidden_size": 1536}}, r"hidden_size = 1536 .* rows of 256"),
    "config eos": ({"config": {"eos_token_id": 1}}, r"eos_token_id = 1 \(model .* has 2\)"),
    "config eos list": ({"config": {"eos_token_id": [2]}}, r"eos_token_id = \[2\]"),
    "config dtype": ({"config": {"torch_dtype": "float32"}}, r"torch_dtype = 'float32' \(vLLM 0\.33 keeps"),
    "missing embedder": ({"edit": _drop(E + "5.weight")}, rf"tensor {re.escape(E)}5\.weight not found in any shard"),
    "an extra embedder": ({"edit": lambda t: t.update({E + "12.weight": t[E + "0.weight"].clone()})},
                          r"embedders\.12\.weight: model .* has 12 n-gram tables"),
    "a scale": ({"edit": lambda t: t.update({E + "0.weight_scale": torch.ones(1)})},
                r"embedders\.0\.weight_scale is no n-gram table tensor"),
    "short table": ({"edit": _set(E + "3.weight", lambda w: w[:-1])},
                    r"embedders\.3\.weight has shape \[2051, 256\], model .* needs \[2052, 256\]"),
    "narrow rows": ({"edit": _set(E + "0.weight", lambda w: w[:, :128])}, r"has shape \[2046, 128\]"),
    "float32 table": ({"edit": _set(E + "7.weight", lambda w: w.float())},
                      r"embedders\.7\.weight has dtype F32; .* would cast F32 into its BF16 table"),
    "float16 table": ({"edit": _set(E + "0.weight", lambda w: w.view(torch.float16))}, r"has dtype F16"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_checkpoint_is_refused_naming_what_is_wrong_and_leaves_nothing(case, tmp_path):
    options, match = REFUSALS[case]
    options = dict(options)
    if "config" in options:
        options["config"] = _config(SPEC, **options["config"])
    make_checkpoint(tmp_path / "ckpt", SPEC, files=2, **options)
    with pytest.raises(errors.CheckpointImportError, match=match):
        import_checkpoint(tmp_path / "ckpt", tmp_path / "out", SPEC)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_no_config_needs_a_model(tmp_path):
    expected = make_checkpoint(tmp_path / "ckpt", SPEC, files=1, config=False)
    with pytest.raises(errors.CheckpointImportError, match="no config.json"):
        import_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    import_checkpoint(tmp_path / "ckpt", tmp_path / "out", SPEC)
    np.testing.assert_array_equal(TableSet.open(tmp_path / "out").read_rows(0, np.arange(SPEC.rows(0))), expected)
