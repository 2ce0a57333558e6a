"""Qwen4Exp (Qwen3.8-Flash-Next) table sets: the table's one global scale, and checkpoint import.

Checkpoints are written here in vLLM 0.33's tensor names (FP8, BF16, NVFP4; sharded over several
safetensors files) with the ``safetensors`` package; every imported row is compared byte for byte
with the checkpoint's through ``TableSet.read_rows``, and (engine-marked) with what vLLM's own
loader (``Qwen4ExpNGramEmbedding.load_weights`` and ``PLEVocabParallelEmbedding.weight_loader``)
puts in its tables. The scale (vLLM's per-tensor FP8 ``weight_scale``, NVFP4's ``weight_scale_2``) lives in the
manifest's ``table_scales`` and, as float32 bits, in its layer's checksum file header: a
manifest whose scale was changed is refused by ``verify`` and ``serve``, naming the field and
both values. The daemon's Info carries it over the Unix socket and gRPC.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from support.daemon_helpers import REPO, DaemonProcess, daemon_command

from engram_store import errors
from engram_store.cli import main
from engram_store.client.client import EngramClient
from engram_store.format.manifest import MANIFEST
from engram_store.format.tableset import TableSet
from engram_store.models import qwen4exp
from engram_store.models.spec import get_spec
from engram_store.tools.importer import import_checkpoint
from engram_store.tools.synth import TABLE_SCALE_STEP, synth_rows, write_synthetic

SCALE = 0.00005  # prime base 1,000: 16 heads of ~1,000 rows, padded to 16,896 rows
FP8, BF16, NVFP4 = "qwen3.8-flash-next", "qwen3.8-flash-next-bf16", "qwen3.8-flash-next-nvfp4"
ULP_UP = float(np.nextafter(np.float32(TABLE_SCALE_STEP), np.float32(1)))  # the synthetic scale, one float32 step up


@pytest.fixture(scope="module")
def synth_sets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen-synth")
    out = {}
    for name in (FP8, BF16, NVFP4):
        write_synthetic(root / name, get_spec(name, SCALE), seed=5)
        out[name] = root / name
    return out


def _edit(directory: Path, change) -> None:
    path = directory / MANIFEST
    path.write_text(json.dumps(change(json.loads(path.read_text())), indent=1))


def test_synth_stores_a_table_scale_exactly_where_the_rows_have_one(synth_sets, tmp_path, capsys):
    for name, want in ((FP8, TABLE_SCALE_STEP), (NVFP4, TABLE_SCALE_STEP), (BF16, None)):
        ts = TableSet.open(synth_sets[name])
        assert ts.table_scale(1) == want and ts.manifest.table_scales == ({} if want is None else {1: want})
        raw = json.loads((synth_sets[name] / MANIFEST).read_text())
        assert ("table_scales" in raw) == (want is not None)
        np.testing.assert_array_equal(ts.read_rows(1, np.arange(0, ts.rows(1), 97)),
                                      synth_rows(ts.spec, 5, 1, np.arange(0, ts.rows(1), 97)))
        assert main(["verify", str(synth_sets[name])]) == 0
    assert TABLE_SCALE_STEP != 1.0 and float(np.float32(TABLE_SCALE_STEP)) == TABLE_SCALE_STEP
    args = ["synth", "--model", FP8, "--scale", str(SCALE), "--out", str(tmp_path / "s")]
    assert main(args + ["--table-scale", "0.375"]) == 0
    assert TableSet.open(tmp_path / "s").table_scale(1) == 0.375
    capsys.readouterr()
    assert main(args + ["--table-scale", "0.1", "--force"]) == 2  # not a float32 value
    assert "not a float32 value" in capsys.readouterr().err
    assert main(["synth", "--model", BF16, "--scale", str(SCALE), "--out", str(tmp_path / "b"),
                 "--table-scale", "0.5"]) == 2
    assert "has no table scale" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def _set_scale(value):
    def change(m: dict) -> dict:
        m["table_scales"] = {"1": value}
        return m
    return change


def _drop_scales(m: dict) -> dict:
    del m["table_scales"]
    return m


# name -> (model, manifest edit, what the one message must say)
LIES = {
    "scale changed": (FP8, _set_scale(0.5), r"layer 1: field 'table_scales' is 0.5, its checksum file was "
                                            r"written with 0.013671875"),
    "nvfp4 scale one ulp up": (NVFP4, _set_scale(ULP_UP), rf"field 'table_scales' is {ULP_UP!r}, its checksum "
                                                          r"file was written with 0.013671875"),
    "scale not float32": (FP8, _set_scale(0.1), r"layer 1: field 'table_scales' is 0.1, not a float32 value"),
    "scale negative": (FP8, _set_scale(-0.013671875), r"layer 1: field 'table_scales' is -0.013671875, a table "
                                                      r"scale must be finite and > 0"),
    "scale missing": (FP8, _drop_scales, r"layer 1: field 'table_scales' has no scale for it"),
    "scale on bf16": (BF16, _set_scale(0.5), r"layer 1: field 'table_scales' gives 0.5, the spec's rows "
                                             r"\(bfloat16\) have no table scale"),
}


def _liar(synth_sets, name: str, where: Path) -> Path:
    """A copy of the synthetic set of the case's model, its manifest edited by the case."""
    model, lie, _ = LIES[name]
    shutil.copytree(synth_sets[model], where)
    _edit(where, lie)
    return where


@pytest.mark.parametrize("name", list(LIES))
def test_verify_refuses_a_manifest_whose_table_scale_lies(synth_sets, name, tmp_path, capsys):
    liar, match = _liar(synth_sets, name, tmp_path / "set"), LIES[name][2]
    with pytest.raises(errors.TableFormatError, match=match):
        TableSet.open(liar)
    capsys.readouterr()
    assert main(["verify", str(liar)]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and err.count("\n") == 1, err


def test_serve_refuses_a_changed_table_scale(synth_sets, tmp_path):
    liar = _liar(synth_sets, "scale changed", tmp_path / "set")
    args = daemon_command() + ["serve", "--tables", str(liar), "--socket", str(tmp_path / "d.sock"),
                               "--grpc", "", "--metrics", "", "--log-level", "WARNING", "--dram-bytes", "1MiB"]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(LIES["scale changed"][2], proc.stderr), proc.stderr


def test_info_carries_the_table_scales_over_unix_and_grpc(synth_sets, tmp_path):
    for i, (name, want) in enumerate(((FP8, {"1": TABLE_SCALE_STEP}), (BF16, None))):
        (tmp_path / f"d{i}").mkdir()  # short: the socket path must fit a sockaddr_un (107 bytes)
        with DaemonProcess(synth_sets[name], tmp_path / f"d{i}", dram_bytes="1MiB") as d:
            clients = [EngramClient.connect(d.unix), EngramClient.connect(d.grpc, token_file=d.token_file)]
            try:
                for client in clients:
                    info = client.info()
                    assert info.get("table_scales") == want and ("table_scales" in info) == (want is not None)
            finally:
                for client in clients:
                    client.close()


# --------------------------------------------------------------------------- checkpoint import
def _config(spec, parts: int, **changes) -> dict:
    """A Qwen4Exp config.json for ``spec``: PLE fields under text_config, as the published checkpoints hold them."""
    text = qwen4exp.spec_values(spec) | {"split_ngram_parts": parts, "model_type": "qwen4_exp_text"}
    text["eos_token_id"] = [text["eos_token_id"], 1]  # a list: the first entry is the boundary
    return {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
            "text_config": text | changes}


def make_checkpoint(path: Path, spec, *, parts: int = 5, files: int = 3, prefix: str = "model.language_model.",
                    seed: int = 0, scale=None, scale_dtype=torch.bfloat16, whole: bool = False, config=None,
                    edit=None) -> np.ndarray:
    """A checkpoint of ``spec``'s PLE tables (random bytes) in vLLM's tensor names, its shards dealt
    over ``files`` safetensors files with an unrelated tensor; ``edit(tensors)`` changes it before
    writing. Returns the rows the import must give, ``[layers, rows, row_bytes]``."""
    rng = np.random.default_rng(seed)
    fmt = spec.row_format
    tensors, expected = {}, []
    for d, layer in enumerate(spec.layers):
        p = f"{prefix}layers.{layer}.ple.ple_embedding."
        rows = spec.rows(layer)
        table = rng.integers(0, 256, (rows, fmt.row_bytes), dtype=np.uint8)
        expected.append(table)
        payload, blocks = table[:, : fmt.payload_bytes], table[:, fmt.payload_bytes :]
        size = -(-rows // parts)
        pieces = [(f"{p}ngram_embedding.", 0, rows)] if whole else \
            [(f"{p}ngram_embedding.shard_{k}.", k * size, max(0, min(size, rows - k * size))) for k in range(parts)]
        for name, first, n in pieces:
            tensors[name + "weight"] = _as(payload[first : first + n], fmt.payload_dtype)
            if fmt.scale_block:
                tensors[name + "weight_scale"] = torch.from_numpy(blocks[first : first + n].copy()).view(
                    torch.float8_e4m3fn)
        if fmt.table_scale_dtype:
            value = (TABLE_SCALE_STEP * (d + 3)) if scale is None else scale
            leaf = "weight_scale_2" if fmt.scale_block else "weight_scale"
            tensors[f"{p}ngram_embedding.{leaf}"] = torch.tensor(value, dtype=scale_dtype)
        tensors[f"{p}layer_multipliers"] = torch.from_numpy(spec.multipliers_array(layer))
        tensors[f"{p}ngram_heads_vocab_sizes"] = torch.from_numpy(spec.primes(layer).ravel().copy())
        tensors[f"{p}ngram_heads_offsets"] = torch.from_numpy(spec.offsets(layer).ravel().copy())
        tensors[f"{p}hashstats_hits"] = torch.zeros(3)
        tensors[f"{prefix}layers.{layer}.ple.kv_proj.weight"] = torch.zeros(4, 4)
    if edit:
        edit(tensors)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    for i in range(files):
        save_file({n: tensors[n].contiguous() for n in names[i::files]},
                  str(path / f"model-{i + 1:05d}-of-{files:05d}.safetensors"))
    if config is not False:  # False: no config.json (the shard size comes from shard 0)
        (path / "config.json").write_text(json.dumps(_config(spec, parts) if config is None else config))
    return np.stack(expected)


def _as(raw: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(raw))
    return {"float8_e4m3fn": lambda: t.view(torch.float8_e4m3fn), "bfloat16": lambda: t.view(torch.bfloat16),
            "float4_e2m1fn": lambda: t}[dtype]()


def _assert_imported(out: Path, spec, expected: np.ndarray, scales) -> None:
    ts = TableSet.open(out)
    for d, layer in enumerate(spec.layers):
        np.testing.assert_array_equal(ts.read_rows(layer, np.arange(ts.rows(layer))), expected[d])
        assert ts.table_scale(layer) == scales[d]
    assert main(["verify", str(out)]) == 0


# (model, checkpoint options, the table scales the import must store)
ROUND_TRIPS = {
    "fp8, bf16 scale": (FP8, {}, [float(torch.tensor(TABLE_SCALE_STEP * 3, dtype=torch.bfloat16))]),
    "fp8, f32 scale, unsharded, model.": (FP8, {"whole": True, "prefix": "model.", "scale": 0.3,
                                                "scale_dtype": torch.float32}, [float(np.float32(0.3))]),
    "bf16, 7 parts over 2 files": (BF16, {"parts": 7, "files": 2}, [None]),
    "nvfp4, f32 scale_2": (NVFP4, {"parts": 4, "scale_dtype": torch.float32}, [float(np.float32(TABLE_SCALE_STEP * 3))]),
    "nvfp4, no config.json": (NVFP4, {"parts": 6, "config": False, "prefix": ""},
                              [float(torch.tensor(TABLE_SCALE_STEP * 3, dtype=torch.bfloat16))]),
}



@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_import_gives_the_checkpoints_rows_and_scale(case, tmp_path):
    model, options, scales = ROUND_TRIPS[case]
    spec = get_spec(model, SCALE)
    expected = make_checkpoint(tmp_path / "ckpt", spec, **options)
    import_checkpoint(tmp_path / "ckpt", tmp_path / "out", spec, block_rows=3000)  # blocks cross shard boundaries
    _assert_imported(tmp_path / "out", spec, expected, scales)


def test_cli_import_takes_the_spec_from_config_and_verify_finds_a_flipped_byte(tmp_path, capsys):
    spec = get_spec(NVFP4, SCALE)
    expected = make_checkpoint(tmp_path / "ckpt", spec, parts=3)
    assert main(["import", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    ts = TableSet.open(tmp_path / "out")
    assert ts.spec.row_format == spec.row_format and ts.spec.primes(1).tolist() == spec.primes(1).tolist()
    assert ts.spec.multipliers == spec.multipliers and ts.spec.rows(1) == spec.rows(1) and ts.spec.pad_id == qwen4exp.EOS
    _assert_imported(tmp_path / "out", ts.spec, expected, [float(torch.tensor(TABLE_SCALE_STEP * 3,
                                                                               dtype=torch.bfloat16))])
    data = tmp_path / "out" / ts.manifest.layer(1).file
    raw = bytearray(data.read_bytes())
    raw[5 * 4096 + 17] ^= 0x10
    data.chmod(0o640)
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "out")]) == 1
    assert re.search(r"CORRUPT layer 1: page 5 \(bytes 20480\.\.24575", capsys.readouterr().err)


def _drop(name):
    return lambda t: t.pop(next(k for k in t if k.endswith(name)))


def _retype(name, dtype):
    def edit(t):
        key = next(k for k in t if k.endswith(name))
        t[key] = t[key].view(torch.uint8).view(dtype) if t[key].element_size() == 1 else t[key].to(dtype)
    return edit


def _bump(name):
    def edit(t):
        key = next(k for k in t if k.endswith(name))
        t[key] = t[key].clone()
        t[key][-1] += 1
    return edit


# name -> (model, checkpoint options, what the one error must say)
REFUSALS = {
    "config seed": (FP8, {"config": {"seed": 1235}}, r"seed = 1235 \(model '.*' has 1234\)"),
    "config base": (FP8, {"config": {"ngram_vocab_size_base": 999}}, r"ngram_vocab_size_base = 999"),
    "config eos": (FP8, {"config": {"eos_token_id": [7, 248044]}}, r"eos_token_id = \[7, 248044\]"),
    "config layers": (FP8, {"config": {"ple_layer_ids": [3]}}, r"ple_layer_ids = \[3\] \(model '.*' has \[2\]\)"),
    "config dtype": (FP8, {"config": {"ple_embedding_dtype": "nvfp4"}}, r"ple_embedding_dtype = 'nvfp4'"),
    "config parts": (FP8, {"config": {"split_ngram_parts": 8}}, r"config.json split_ngram_parts = 8 gives shards of "
                                                             r"2112 rows"),
    "buffer multipliers": (FP8, {"edit": _bump("layer_multipliers")}, r"field layer_multipliers is \[.*\], model"),
    "buffer offsets": (NVFP4, {"edit": _bump("ngram_heads_offsets")}, r"field ngram_heads_offsets is"),
    "missing shard": (FP8, {"edit": _drop("shard_2.weight")}, r"tensor model\.language_model\.layers\.1\.ple\."
                                                              r"ple_embedding\.ngram_embedding\.shard_2\.weight not found"),
    "missing block scales": (NVFP4, {"edit": _drop("shard_4.weight_scale")}, r"shard_4\.weight_scale not found"),
    "missing table scale": (FP8, {"edit": _drop("ngram_embedding.weight_scale")},
                            r"ngram_embedding\.weight_scale \(the table's one scale\) not found"),
    "fp8 rows as bf16": (FP8, {"edit": _retype("shard_1.weight", torch.bfloat16)},
                         r"shard_1\.weight has dtype BF16, model .* needs F8_E4M3"),
    "nvfp4 scales as u8": (NVFP4, {"edit": _retype("shard_0.weight_scale", torch.uint8)},
                           r"shard_0\.weight_scale has dtype U8, .* needs F8_E4M3"),
    "scale as i32": (FP8, {"edit": _retype("ngram_embedding.weight_scale", torch.int32)},
                     r"weight_scale has dtype I32, a table scale is one of"),
    "scale zero": (FP8, {"scale": 0.0}, r"weight_scale = 0\.0: .*finite and > 0"),
    "nvfp4 unsharded": (NVFP4, {"whole": True}, r"an NVFP4 table must be stored as shard_<k>\.weight"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_checkpoint_is_refused_naming_what_is_wrong_and_leaves_nothing(case, tmp_path):
    model, options, match = REFUSALS[case]
    spec = get_spec(model, SCALE)
    options = dict(options)
    if "config" in options:  # the case's fields changed in the checkpoint's config.json
        options["config"] = _config(spec, 5, **options["config"])
    make_checkpoint(tmp_path / "ckpt", spec, **options)
    with pytest.raises(errors.CheckpointImportError, match=match):
        import_checkpoint(tmp_path / "ckpt", tmp_path / "out", spec)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.engine
def test_vllms_own_loader_puts_the_imported_rows_in_its_tables(tmp_path):
    """vLLM's ``load_weights``/``weight_loader`` (tests/support/vllm_qwen4exp_loader.py) loads the same
    checkpoints over 2 or 4 ETP ranks: its tables, concatenated, equal the imported table set."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    jobs, sets = [], {}
    for fmt, model, parts, etp in (("fp8", FP8, 5, 2), ("bf16", BF16, 7, 4), ("nvfp4", NVFP4, 4, 4)):
        spec = get_spec(model, SCALE)
        make_checkpoint(tmp_path / fmt, spec, parts=parts, seed=len(jobs))
        import_checkpoint(tmp_path / fmt, tmp_path / f"{fmt}-out", spec)
        sets[fmt] = spec
        jobs.append({"ckpt": str(tmp_path / fmt), "prefix": "model.language_model.layers.1.ple.ple_embedding.",
                     "format": fmt, "rows": spec.rows(1), "dim": spec.row_format.dim, "parts": parts, "etp": etp,
                     "out": str(tmp_path / f"{fmt}.npz")})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "VLLM_"))}
    result = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "vllm_qwen4exp_loader.py"),
                             str(tmp_path / "jobs.json")], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for fmt, spec in sets.items():
        got = np.load(tmp_path / f"{fmt}.npz")
        ts = TableSet.open(tmp_path / f"{fmt}-out")
        np.testing.assert_array_equal(got["rows"], ts.read_rows(1, np.arange(ts.rows(1))))
        np.testing.assert_array_equal(got["layer_multipliers"], spec.multipliers_array(1))
        np.testing.assert_array_equal(got["ngram_heads_offsets"], spec.offsets(1).ravel())
