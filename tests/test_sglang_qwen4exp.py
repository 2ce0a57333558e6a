"""The SGLang plugin serving Qwen4Exp's (Qwen3.8-Flash-Next) PLE n-gram table: SGLang 0.5.23's own
``Qwen4ExpNGramEmbedding``, ``Qwen4ExpPinnedHostEmbedding`` and ``Qwen4ExpPLELayer`` prefetch on CPU (Triton's
interpreter runs SGLang's gather kernel), in ``.venv-sglang``, against real daemons: FP8 and BF16 tables of
three PLE layers (1 resident, 3 and 5 cached), and an NVFP4 one (refused); a prefill SGLang's scheduler plans
(its own ``Req``) hints the cached layers' rows of the prompt's later chunks, which the daemon reads ahead. One
process of ``tests/engines/sglang_qwen4exp.py`` per daemon, run side by side; bytes compared there with SGLang's
own classes loaded from ``TableSet.read_rows``, ids with engram-store's spec hash."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
from support.daemon_helpers import REPO, DaemonProcess

from engram_store.models.spec import get_spec

SGLANG_PYTHON = Path(os.environ.get("ENGRAM_STORE_SGLANG_PYTHON", REPO / ".venv-sglang" / "bin" / "python"))
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                 reason=f"{SGLANG_PYTHON} is absent (make engine-test builds .venv-sglang)")]

SCRIPT = REPO / "tests" / "engines" / "sglang_qwen4exp.py"
SCALE = 0.0002  # ~65k rows of 160 values a layer: 10 MB FP8, 21 MB BF16
LAYERS = (1, 3, 5)  # decoder layers (ple_layer_ids 2, 4, 6): dense ids 0, 1, 2
CORRUPT_LAYER = 5  # flipped in the FP8 set after its daemon started; the other scenarios never read it
TIMEOUT = 300


def spec_of(name: str):
    """``name``'s spec at SCALE with three PLE layers (multipliers by vLLM's and SGLang's recipe)."""
    from engram_store.models.qwen4exp import splitmix_multipliers

    spec = get_spec(name, SCALE)
    multipliers = {layer: splitmix_multipliers(d, spec.compressed_vocab, spec.max_ngram, spec.seed, spec.seed_factor)
                   for d, layer in enumerate(LAYERS)}
    return dataclasses.replace(spec, name=f"{name}-3ple", layers=LAYERS, multipliers=multipliers)


def daemon(tables: Path, spec, workdir: Path) -> DaemonProcess:
    """Layer 1 resident, 3 and 5 cached behind a cache of 8 MiB (its hinted share above a prompt's rows)."""
    from engram_store.storage.resident import resident_layout

    dram = resident_layout([(1, spec.rows(1))], spec.row_format).size + (8 << 20)
    workdir.mkdir()
    return DaemonProcess(tables, workdir, dram_bytes=str(dram), extra=["--placement", "1=resident,3=cached,5=cached"])


def launch(name: str, *args, address: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "SGLANG_"))}
    env |= {"ENGRAM_STORE_ADDR": address, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
            "SGLANG_PLUGINS": "engram_store", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([str(SGLANG_PYTHON), str(SCRIPT), name, *map(str, args)], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def corrupt_page(spec) -> int:
    """A page of CORRUPT_LAYER that the scenario's corrupt step reads (its first token's first row)."""
    from support.qwen4exp_batch import batch

    from engram_store.format.layout import PAGE_BYTES
    from engram_store.models.hashing import row_ids_numpy

    tokens, qsl, ctx = batch(spec, seed=11)
    return int(row_ids_numpy(spec, CORRUPT_LAYER, tokens, qsl, ctx)[0, 0]) // (PAGE_BYTES // spec.row_bytes)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every scenario's output and the flipped page, the three processes run side by side (SGLang's
    import is most of each)."""
    from support.storage_helpers import flip

    from engram_store.tools.synth import write_synthetic

    root = tmp_path_factory.mktemp("sglang-qwen")
    specs = {"fp8": spec_of("qwen3.8-flash-next"), "bf16": spec_of("qwen3.8-flash-next-bf16"),
             "nvfp4": get_spec("qwen3.8-flash-next-nvfp4", SCALE)}
    for key, spec in specs.items():
        write_synthetic(root / key, spec, seed=23)
    (root / "d-nvfp4").mkdir()
    with daemon(root / "fp8", specs["fp8"], root / "d-fp8") as fp8, \
            daemon(root / "bf16", specs["bf16"], root / "d-bf16") as bf16, \
            DaemonProcess(root / "nvfp4", root / "d-nvfp4") as nvfp4:
        page = corrupt_page(specs["fp8"])
        flip(root / "fp8", CORRUPT_LAYER, page)  # after the start: the daemon never read it
        runs = {"fp8": launch("serve", root / "fp8", page, address=fp8.unix),
                "bf16": launch("serve", root / "bf16", address=bf16.unix),
                "nvfp4": launch("refuse", root / "nvfp4", address=nvfp4.unix)}
        out = {}
        for key, proc in runs.items():
            try:
                out[key] = proc.communicate(timeout=TIMEOUT)[0]
            finally:
                proc.kill()
            assert proc.returncode == 0, f"{key}:\n{out[key][-6000:]}"
    return out, page


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_sglangs_ple_table_is_the_daemons(outputs, fmt):
    out = outputs[0][fmt]
    dtype = "float8_e4m3fn" if fmt == "fp8" else "bfloat16"
    assert "engram-store plugin ACTIVE: SGLang 0.5.23 reads Qwen4Exp PLE n-gram" in out, out[-3000:]
    for layer, where in ((1, "resident"), (3, "cached")):
        for path in ("offload gather", "offload prefetch seam", "inline lookup"):
            assert f"OK layer {layer} {where} {dtype} {path}: equal to SGLang's own" in out, out[-3000:]
        assert f"OK layer {layer} {where} {dtype}: 2 TP ranks" in out, out[-3000:]


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_sglangs_ids_are_the_spec_hash(outputs, fmt):
    out = outputs[0][fmt]
    line = next(line for line in out.splitlines() if line.startswith("OK ids"))
    assert int(line.split()[2]) >= 3000 and "EOS" in line and "requests" in line, line


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_a_planned_prefill_hints_the_rows_its_later_chunks_fetch(outputs, fmt):
    out = outputs[0][fmt]
    line = next((line for line in out.splitlines() if line.startswith("OK hints: ")), None)
    assert line is not None and "layers [3, 5]" in line and "withdrawn when it finished" in line, out[-3000:]


def refusals(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("OK refused")]


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_config_and_checkpoint_are_checked(outputs, fmt):
    out = outputs[0][fmt]
    words = ["rows of Engram layer 1", "PLE row format", "PLE multipliers of PLE layer 1: SGLang's Qwen4Exp config",
             "--ple-offload-backend file", "the checkpoint's model.layers.1.ple.ple_embedding.layer_multipliers",
             "--load-format dummy"]
    if fmt == "fp8":  # one table scale, the daemon's
        words.append("table scale: the checkpoint says")
    for word in words:
        assert any(word in line for line in refusals(out)), (word, out[-3000:])
    assert "OK checkpoint's PLE table tensors skipped (never read)" in out, out[-3000:]


def test_a_failed_fetch_is_raised_before_the_steps_tokens(outputs):
    out, page = outputs
    assert f"OK CorruptRows at process_batch_result: layer {CORRUPT_LAYER}, page {page}" in out["fp8"], \
        out["fp8"][-3000:]


def test_an_nvfp4_table_is_refused(outputs):
    out = outputs[0]["nvfp4"]
    assert any("NVFP4 PLE table" in line and "FP8 and BF16 PLE tables only" in line for line in refusals(out)), \
        out[-3000:]

