"""The vLLM plugin serving LongCat-Flash-Lite's n-gram tables: vLLM 0.33's own ``NgramEmbedding`` on CPU
(``--no-deps`` in ``.venv``) with ``oe_embedder``'s rows the daemon's, resident and cached, against a real daemon.
Each scenario runs in a fresh process of ``tests/support/vllm_longcat_plugin.py``, which compares
``embed_batched`` with vLLM's own ``NgramEmbedding`` loaded from ``TableSet.read_rows``, on one and two TP ranks."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from support.daemon_helpers import REPO, DaemonProcess

from engram_store.format.layout import PAGE_BYTES
from engram_store.models.spec import get_spec
from engram_store.tools.synth import write_synthetic

NAME = "longcat-flash-lite"
SCALE = 0.0005  # m = 5,112: 61,488 rows of 512 B (31 MB)
SCRIPT = REPO / "tests" / "support" / "vllm_longcat_plugin.py"
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def scenario(name: str, *args: str, address: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "VLLM_"))}
    env |= {"ENGRAM_STORE_ADDR": address, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, str(SCRIPT), name, *map(str, args)], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout


def test_the_checkpoints_table_tensors_are_skipped():
    from engram_store.integrations.models.longcat import LONGCAT
    from engram_store.integrations.vllm.longcat import with_table_names

    rule = with_table_names(re.compile(r"(?:^|\.)engram\.embed\.(?:weight|scale)$"))
    for name in ("model.ngram_embeddings.embedders.0.weight", "ngram_embeddings.embedders.11.weight",
                 "model.layers.14.engram.embed.scale"):
        assert rule.search(name), name
        assert LONGCAT.is_table_tensor(name) == ("ngram_embeddings" in name), name
    for name in ("model.ngram_embeddings.post_projs.0.weight", "model.embed_tokens.weight",
                 "model.ngram_embeddings.embedders.0.weight_scale"):
        assert not rule.search(name) and not LONGCAT.is_table_tensor(name), name


def test_the_daemons_rows_count_as_loaded_and_are_never_written():
    import types

    from engram_store.integrations.vllm.longcat import WEIGHT, _load_weight, _load_weights

    served, stock = types.SimpleNamespace(), types.SimpleNamespace()
    served.__dict__["_engram_store"] = object()
    load_weights = _load_weights(lambda self, weights: {"layers.0.mlp.weight"})
    assert load_weights(types.SimpleNamespace(ngram_embeddings=served), []) == {"layers.0.mlp.weight", WEIGHT}
    assert load_weights(types.SimpleNamespace(ngram_embeddings=stock), []) == {"layers.0.mlp.weight"}
    assert load_weights(types.SimpleNamespace(ngram_embeddings=None), []) == {"layers.0.mlp.weight"}
    written = []
    load_weight = _load_weight(lambda self, name, w: written.append(name) or "copied")
    assert load_weight(served, "model.ngram_embeddings.embedders.3.weight", None) == WEIGHT and not written
    assert load_weight(served, "model.ngram_embeddings.post_projs.3.weight", None) == "copied"
    assert load_weight(stock, "model.ngram_embeddings.embedders.3.weight", None) == "copied"


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    directory = tmp_path_factory.mktemp("longcat-plugin") / "tables"
    write_synthetic(directory, get_spec(NAME, SCALE), seed=31)
    return directory


@needs_vllm
@pytest.mark.engine  # a scenario takes ~45 s (vLLM's import): the cached one runs in make test, this one in engine-test
def test_resident_table_read_in_place_by_vllms_lookup(tables, tmp_path):
    with DaemonProcess(tables, tmp_path, dram_bytes="1GiB") as d:
        assert d.ready["mode"] == "resident"
        out = scenario("lookups", tables, address=d.unix)
    assert out.count("OK resident: ") == 2, out
    assert "mismatch named: LongCat table dtype" in out and "mismatch named: rows of Engram layer 0" in out, out


@needs_vllm
def test_cached_table_fetched_in_embed_batched_and_a_failed_page_raised_there(tmp_path):
    from support.storage_helpers import flip

    directory, spec = tmp_path / "tables", get_spec(NAME, SCALE)
    write_synthetic(directory, spec, seed=32)
    page = spec.rows(0) // (PAGE_BYTES // spec.row_bytes) // 3
    with DaemonProcess(directory, tmp_path, dram_bytes="256KiB") as d:
        assert d.ready["mode"] == "cached"
        flip(directory, 0, page)  # after the start: neither the daemon nor its cache has read it
        out = scenario("lookups", directory, str(page), address=d.unix)
    assert out.count("OK cached: ") == 2, out
    assert re.search(rf"OK CorruptRows from embed_batched before its rows were used: .*layer 0.*\b{page}\b", out), out
