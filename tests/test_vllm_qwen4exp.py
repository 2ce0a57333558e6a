"""The vLLM plugin serving Qwen4Exp's (Qwen3.8-Flash-Next) PLE n-gram table: vLLM 0.33's own
``Qwen4ExpNGramEmbedding`` on CPU (``--no-deps`` in ``.venv``) with its storage the daemon's, resident and
cached, FP8, BF16 and NVFP4, against a real daemon. Each scenario runs in a fresh process of
``tests/support/vllm_qwen4exp_plugin.py``, which compares the lookups with vLLM's own storage class loaded
from ``TableSet.read_rows`` and with ``read_rows`` itself."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from support.daemon_helpers import REPO, DaemonProcess

from engram_store.models.spec import get_spec
from engram_store.tools.synth import write_synthetic

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

NAME = "qwen3.8-flash-next"
SCALE = 0.0005  # 160k rows of 160 values: 26 MB FP8, 51 MB BF16
SCRIPT = REPO / "tests" / "support" / "vllm_qwen4exp_plugin.py"


def scenario(name: str, *args: str, address: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "VLLM_"))}
    env |= {"ENGRAM_STORE_ADDR": address, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, str(SCRIPT), name, *map(str, args)], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


def test_the_checkpoints_table_tensors_are_skipped_and_its_scales_read():
    import re

    from engram_store.integrations.models.qwen4exp import QWEN4EXP
    from engram_store.integrations.vllm.qwen4exp import with_table_names

    v41 = re.compile(r"(?:^|\.)engram\.embed\.(?:weight|scale)$")
    rule = with_table_names(v41)
    p = "model.layers.1.ple.ple_embedding."
    for name in (p + "ngram_embedding.shard_0.weight", p + "ngram_embedding.shard_127.weight_scale",
                 p + "ngram_embedding.weight", "layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight",
                 "model.layers.14.engram.embed.scale"):
        assert rule.search(name), name
        assert QWEN4EXP.is_table_tensor(name) == ("ple" in name), name
    for name in (p + "ngram_embedding.weight_scale", p + "ngram_embedding.weight_scale_2", p + "layer_multipliers",
                 "model.layers.1.ple.kv_proj.weight", "model.embed_tokens.weight"):
        assert not rule.search(name) and not QWEN4EXP.is_table_tensor(name), name


ENGINE = pytest.mark.engine  # a scenario takes ~40 s (vLLM's import): one runs in make test, the rest in engine-test


@pytest.fixture(scope="module")
def table_sets(tmp_path_factory):
    """``table_sets(name)``: a synthetic table set of spec ``name`` at SCALE, written once per module."""
    made = {}

    def make(name: str):
        if name not in made:
            made[name] = tmp_path_factory.mktemp("qwen-plugin") / "tables"
            write_synthetic(made[name], get_spec(name, SCALE), seed=21)
        return made[name]

    return make


@pytest.mark.parametrize("name, mode", [(NAME, "resident"), pytest.param(NAME, "cached", marks=ENGINE),
                                        pytest.param(f"{NAME}-bf16", "resident", marks=ENGINE),
                                        pytest.param(f"{NAME}-bf16", "cached", marks=ENGINE),
                                        pytest.param(f"{NAME}-nvfp4", "resident", marks=ENGINE),
                                        pytest.param(f"{NAME}-nvfp4", "cached", marks=ENGINE)])
def test_vllms_ngram_embedding_reads_the_daemons_table(table_sets, name, mode, tmp_path):
    tables = table_sets(name)
    with DaemonProcess(tables, tmp_path, dram_bytes="1GiB" if mode == "resident" else "256KiB") as d:
        assert d.ready["mode"] == mode
        out = scenario("lookups", tables, address=d.unix)
    assert out.count(f"OK {mode} ") == 3, out  # the prefetch seam, inline, two ETP ranks
    assert f"OK amd {mode} " in out, out  # ROCm's copy of the class (amd/ple_layer.py): served, or NVFP4 refused
    assert "engram-store plugin ACTIVE: vLLM 0.33.0 reads Qwen4Exp PLE n-gram tables" in out, out
    assert "mismatch named: rows of Engram layer 1" in out and "mismatch named: PLE row format" in out, out


@ENGINE
def test_a_page_failing_its_checksum_raises_at_the_steps_check(tmp_path):
    from support.storage_helpers import flip
    from support.qwen4exp_batch import batch

    from engram_store.format.layout import PAGE_BYTES
    from engram_store.models.hashing import row_ids_numpy

    directory, spec = tmp_path / "tables", get_spec(NAME, SCALE)
    write_synthetic(directory, spec, seed=22)
    tokens, qsl, ctx = batch(spec, seed=3)  # the scenario's step
    page = int(row_ids_numpy(spec, spec.layers[0], tokens, qsl, ctx)[0, 0]) // (PAGE_BYTES // spec.row_bytes)
    with DaemonProcess(directory, tmp_path, dram_bytes="256KiB") as d:
        flip(directory, spec.layers[0], page)  # after the start: neither the daemon nor its cache has read it
        out = scenario("corrupt", directory, str(page), address=d.unix)
    assert "CorruptRows at the step's check" in out, out
