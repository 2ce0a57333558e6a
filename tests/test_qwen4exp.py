"""Qwen4Exp (Qwen3.8-Flash-Next): its PLE n-gram table spec, row ids against vLLM 0.33's own
``ple_ngram_ids`` (Triton kernel under the interpreter) and CPU fallback on thousands of positions
across request boundaries and EOS, and a synthetic table set that verify accepts and a daemon serves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.qwen4exp_reference import vllm_reference

from engram_store.errors import InvalidRequest
from engram_store.format.tableset import TableSet
from engram_store.models.hashing import row_ids, row_ids_numpy, row_ids_torch
from engram_store.models.spec import ModelSpec, get_spec

NAME = "qwen3.8-flash-next"
SPEC = get_spec(NAME)
EOS = SPEC.pad_id
REPO = Path(__file__).resolve().parents[1]


def test_spec_is_vllms_table():
    assert SPEC.layers == (1,) and SPEC.rows_per_token == 16 and SPEC.history_len == 2
    primes = SPEC.primes(1).reshape(-1)
    assert primes[0] == 20_000_003 and primes[-1] == 20_000_171 and primes.sum() == 320_001_446
    assert SPEC.rows(1) == 320_001_536  # padded to 128, as vLLM pads the table
    SPEC.check_expected_rows()
    assert SPEC.offsets(1).reshape(-1)[8] == 160_000_374
    sizes = {name: get_spec(name).row_bytes * SPEC.rows(1) for name in
             (NAME, f"{NAME}-bf16", f"{NAME}-nvfp4")}
    assert sizes == {NAME: 51_200_245_760, f"{NAME}-bf16": 102_400_491_520, f"{NAME}-nvfp4": 28_800_138_240}
    nvfp4 = get_spec(f"{NAME}-nvfp4").row_format
    assert (nvfp4.payload_bytes, nvfp4.scale_count, nvfp4.table_scale_dtype) == (80, 10, "float32")
    assert SPEC.row_format.scale_count == 0 and SPEC.row_format.table_scale_dtype == "float32"


def test_scaled_and_serialized():
    small = get_spec(NAME, 0.001)
    assert small.table_base == 20_000 and small.rows(1) % 128 == 0 and small.boundary == "eos"
    assert ModelSpec.from_dict(small.to_dict()) == small
    v41 = get_spec("deepseek-v4.1-flash").to_dict()  # fields of other families stay out of V4.1's dict
    assert not {"row_pad_to", "boundary", "multiplier_rule", "seed", "token_ids"} & set(v41)
    assert "table_scale_dtype" not in v41["row_format"]


# --------------------------------------------------------------------------- row ids
def _cases(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """Batches as vLLM's model state gives them: per request the chunk after ``num_computed`` tokens,
    ``query_start_loc``, and ``ngram_context`` (the 2 tokens before the chunk, EOS before the start);
    EOS about 10% of tokens (runs of them, in the context, as the current token), empty requests,
    token 0 and the last id."""
    out = []
    for n_req, max_len in ((40, 120), (200, 30), (6, 400)):
        chunks, ctx, before = [], [], []
        for r in range(n_req):
            total = int(rng.integers(0, max_len))
            seq = rng.integers(0, SPEC.compressed_vocab, total + 3)
            seq[rng.random(seq.size) < 0.1] = EOS
            seq[rng.random(seq.size) < 0.01] = 0
            seq[rng.random(seq.size) < 0.01] = SPEC.compressed_vocab - 1
            if r % 7 == 3 and seq.size > 4:
                seq[1:4] = EOS  # a run
            start = int(rng.choice([0, 1, 2, rng.integers(0, seq.size + 1)]))
            start = min(start, seq.size)
            chunks.append(seq[start:])
            ctx.append([seq[p] if p >= 0 else EOS for p in (start - 2, start - 1)])
            before.append([start < 2, start < 1])
        qsl = np.concatenate([[0], np.cumsum([c.size for c in chunks])])
        out.append({"tokens": np.concatenate(chunks), "qsl": qsl, "ctx": np.asarray(ctx, dtype=np.int64),
                    "before": np.asarray(before)})
    return out


@pytest.fixture(scope="module")
def cases():
    return _cases(np.random.default_rng(39))


@pytest.fixture(scope="module")
def vllm_ids(cases, tmp_path_factory):
    arrays = {f"c{i}_{k}": v for i, case in enumerate(cases) for k, v in case.items()}
    return vllm_reference(tmp_path_factory.mktemp("qwen-ref"), SPEC, [SPEC.table_base, get_spec(NAME, 0.001).table_base],
                          [0, 1], EOS, **arrays)


def test_layout_and_multipliers_equal_vllms(vllm_ids):
    for b, spec in enumerate((SPEC, get_spec(NAME, 0.001))):
        two = ModelSpec.from_dict(spec.to_dict() | {"layers": [1, 3], "expected_rows": None,
                                                    "multipliers": {"1": spec.multipliers[1], "3": [1, 1, 1]}})
        for d, layer in enumerate(two.layers):  # dense ids 0 and 1: the prime run goes on across layers
            key = f"b{b}_d{d}_"
            np.testing.assert_array_equal(two.primes(layer).reshape(-1), vllm_ids[key + "sizes"])
            np.testing.assert_array_equal(two.offsets(layer).reshape(-1), vllm_ids[key + "offsets"])
            assert two.rows(layer) == int(vllm_ids[key + "padded"])
            assert two.derived_multipliers(layer) == tuple(int(m) for m in vllm_ids[key + "multipliers"])
        assert spec.multipliers[1] == tuple(int(m) for m in vllm_ids[f"b{b}_d0_multipliers"])


def test_row_ids_equal_vllms_kernel_and_fallback(cases, vllm_ids):
    positions = 0
    for i, case in enumerate(cases):
        ours = row_ids_numpy(SPEC, 1, case["tokens"], case["qsl"], case["ctx"])
        np.testing.assert_array_equal(ours, vllm_ids[f"c{i}_triton"], err_msg=f"case {i}: ple_ngram_ids")
        np.testing.assert_array_equal(ours, vllm_ids[f"c{i}_torch"], err_msg=f"case {i}: compute_ngram_ids")
        lookback = np.where(case["before"], -1, case["ctx"])[:, ::-1]  # newest first, -1 before the start
        np.testing.assert_array_equal(row_ids(SPEC, 1, case["tokens"], case["qsl"], lookback), ours)
        twin = row_ids_torch(SPEC, 1, case["tokens"], case["qsl"], case["ctx"])
        np.testing.assert_array_equal(twin.numpy(), ours)
        positions += ours.shape[0]
    assert positions > 5000
    print(f"{positions} positions equal vLLM's ple_ngram_ids and compute_ngram_ids")


def test_boundaries():
    toks = np.array([5, 9, EOS, 7, 8, EOS, EOS, 3])
    ids = row_ids_numpy(SPEC, 1, toks)
    fresh = row_ids_numpy(SPEC, 1, toks[3:])  # after an EOS a position hashes like a request's start
    np.testing.assert_array_equal(ids[3], fresh[0])
    np.testing.assert_array_equal(ids[4], fresh[1])
    alone = row_ids_numpy(SPEC, 1, [EOS, 7])  # an EOS current token keeps its look-back
    assert not np.array_equal(ids[2], alone[0])
    np.testing.assert_array_equal(row_ids_numpy(SPEC, 1, toks[1:3], history=[[5, 5]])[1], ids[2])
    decode = row_ids_numpy(SPEC, 1, [8], history=[[EOS, 7]])  # one decode step hashes as in prefill
    np.testing.assert_array_equal(decode[0], ids[4])
    with pytest.raises(InvalidRequest, match="token ids"):
        row_ids_numpy(SPEC, 1, [-1, 3])


# --------------------------------------------------------------------------- synth, verify, serve, hash
@pytest.mark.parametrize("name", [NAME, f"{NAME}-bf16", f"{NAME}-nvfp4"])
def test_synth_verify_and_serve(name, tmp_path):
    from engram_store.client.client import EngramClient
    from support.daemon_helpers import DaemonProcess, expected

    out = tmp_path / "tables"
    cli = [sys.executable, "-m", "engram_store"]
    run = subprocess.run(cli + ["synth", "--model", name, "--scale", "0.0005", "--out", str(out)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    tables = TableSet.open(out)
    spec = tables.spec
    assert spec.name == name and tables.row_bytes == spec.row_bytes and spec.rows(1) % 128 == 0
    verify = subprocess.run(cli + ["verify", str(out)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert verify.returncode == 0, verify.stderr
    rows = tables.read_rows(1, np.arange(spec.rows(1)))
    if spec.row_format.payload_dtype == "bfloat16":
        import torch

        values = torch.from_numpy(rows.copy()).view(torch.bfloat16).float()
        assert torch.isfinite(values).all() and values.abs().max() < 2
    tokens = np.random.default_rng(1).integers(0, spec.compressed_vocab, 300)
    tokens[::9] = EOS
    ids = row_ids_numpy(spec, 1, tokens, [0, 120, 300])
    assert ids.max() < spec.rows(1)
    for mode, dram in (("resident", "1GiB"), ("cached", "256KiB")):
        (tmp_path / mode).mkdir()
        with DaemonProcess(out, tmp_path / mode, dram_bytes=dram) as d:
            assert d.ready["mode"] == mode
            with EngramClient.connect(d.unix) as client:
                np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))


def test_hash_command_prints_row_ids():
    cli = [sys.executable, "-m", "engram_store", "hash", "--model", NAME, "--scale", "0.001"]
    run = subprocess.run(cli + ["--tokens", f"5,{EOS},7,8", "--history", "3"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    spec = get_spec(NAME, 0.001)
    assert got["layer"] == 1
    assert got["rows"] == row_ids_numpy(spec, 1, [5, EOS, 7, 8], history=[[EOS, 3]]).tolist()
    bad = subprocess.run(cli + ["--tokens", "-1,4"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode != 0 and "token ids" in bad.stderr
