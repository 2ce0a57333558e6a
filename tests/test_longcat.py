"""LongCat-Flash-Lite: its n-gram table spec against vLLM 0.33's own ``NgramEmbedding`` buffers, row
ids against vLLM 0.33's own ``LongcatNgramModelState`` (``add_request`` and ``_compute_oe_ids`` with
their bookkeeping) on thousands of positions over fresh, prefix-cached and resumed requests, EOS and
chunked steps; SGLang 0.5.23's EOS rule; a synthetic set that verify accepts and a daemon serves.

vLLM's id op, ``torch.ops._C.ngram_compute_n_gram_ids``, is compiled CUDA that CPU builds lack:
here a CPU stand-in runs under its name (tests/support/longcat_ref.py: a loop reading of the
kernel's definition, nothing of engram_store's). On a GPU host the real op replaces it
(``longcat_ref.py ... --device cuda``; bench/device_check.py's ``longcat-op`` row)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engram_store.errors import InvalidRequest, SpecError
from engram_store.format.tableset import TableSet
from engram_store.models.hashing import next_history_numpy, row_ids, row_ids_numpy, row_ids_torch
from engram_store.models.spec import ModelSpec, get_spec
from support.longcat_ref import kernel_ids, lookback, make_script, run_reference

NAME = "longcat-flash-lite"
SPEC = get_spec(NAME)
SMALL = get_spec(NAME, 0.001)
EOS, V = SPEC.pad_id, SPEC.compressed_vocab
REHASH = dataclasses.replace(SPEC, eos_current="rehash")
REPO = Path(__file__).resolve().parents[1]


def test_spec_geometry():
    assert SPEC.layers == (0,) and SPEC.rows_per_token == 12 and SPEC.history_len == 3
    assert SPEC.table_base == 78 * 131_072 == 10_223_616
    sizes = SPEC.sizes(0).reshape(-1)
    assert sizes[0] == 10_223_617 and sizes[-1] == 10_223_639 and (np.diff(sizes) == 2).all()
    assert SPEC.rows(0) == 122_683_536 and SPEC.row_bytes == 512
    SPEC.check_expected_rows()
    assert SPEC.row_bytes * SPEC.rows(0) == 62_813_970_432  # 58.5 GiB of BF16
    assert SMALL.table_base == 10_224 and SMALL.rows(0) == 12 * 10_224 + 144 and SMALL.expected_rows is None
    assert ModelSpec.from_dict(SMALL.to_dict()) == SMALL
    with pytest.raises(SpecError, match="eos_current"):
        ModelSpec.from_dict(SPEC.to_dict() | {"eos_current": "skip"})
    with pytest.raises(SpecError, match="poly_mod"):
        ModelSpec.from_dict(SPEC.to_dict() | {"boundary": "eos"})


# --------------------------------------------------------------------------- vLLM's own code
@pytest.fixture(scope="module")
def script():
    return make_script(np.random.default_rng(39), V, EOS)


@pytest.fixture(scope="module")
def vllm_out(script, tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    ratios = [78, SMALL.table_base / V]  # exact in binary: V is a power of two
    return run_reference({"vocab": V, "hidden": 3072, "eos": EOS, "n": 4, "k": 4, "ratios": ratios, "max_num_reqs": 8,
                          "events": script["events"]}, tmp_path_factory.mktemp("longcat-ref"))


def test_tables_equal_vllms_buffers(vllm_out):
    for i, spec in enumerate((SPEC, SMALL)):
        sizes = spec.sizes(0).reshape(-1)
        np.testing.assert_array_equal(vllm_out[f"r{i}_sizes"], sizes)
        np.testing.assert_array_equal(vllm_out[f"r{i}_mods"], spec.sizes(0))
        np.testing.assert_array_equal(vllm_out[f"r{i}_exclusive"], np.append(spec.offsets(0).reshape(-1), spec.rows(0)))
        np.testing.assert_array_equal(vllm_out[f"r{i}_weights"], spec.poly_weights(0))
        assert int(vllm_out[f"r{i}_rows"]) == spec.rows(0)
        assert int(vllm_out[f"r{i}_oe_dim"]) == spec.row_format.dim
        assert str(vllm_out[f"r{i}_dtype"]) == "torch.bfloat16" == f"torch.{spec.row_format.payload_dtype}"


def test_row_ids_equal_vllms_model_state(script, vllm_out):
    """Every step's ids, stateless (lookback by position) and stateful (our history rolled per slot)."""
    seqs, positions, eos_positions, k = script["seqs"], 0, 0, 0
    history: dict[int, np.ndarray] = {}  # per request, oldest first, -1 for none: as vLLM's token_context
    for event in script["events"]:
        if event[0] == "add":  # seeded by position, as add_request seeds its slot
            computed, r = event[2], event[4]
            history[r] = lookback(seqs, [(r, computed, 0)], 3)[0][::-1]
            continue
        rows = script["plan"][k]
        tokens = np.concatenate([seqs[r][s:s + n] for r, s, n in rows])
        cu = np.concatenate([[0], np.cumsum([n for _, _, n in rows])])
        want = vllm_out[f"s{k}"]
        np.testing.assert_array_equal(row_ids(SPEC, 0, tokens, cu, lookback(seqs, rows, 3)), want, err_msg=f"step {k}")
        hist = np.stack([history[r] for r, _, _ in rows])
        np.testing.assert_array_equal(row_ids_numpy(SPEC, 0, tokens, cu, hist), want, err_msg=f"step {k} history")
        for (r, _, _), h in zip(rows, next_history_numpy(SPEC, tokens, cu, hist)):
            history[r] = h
        if k % 10 == 0:
            np.testing.assert_array_equal(row_ids_torch(SPEC, 0, tokens, cu, hist).numpy(), want)
        k += 1
        positions += tokens.size
        eos_positions += int((tokens == EOS).sum())
    adds = [e for e in script["events"] if e[0] == "add"]
    assert len(adds) > len(seqs) and sum(e[2] > 0 for e in adds) > 5  # resumed and prefix-cached requests
    assert positions > 3000 and eos_positions > 200
    assert k == len(script["plan"])
    print(f"{positions} positions ({eos_positions} EOS) in {k} steps equal vLLM's model state")


def test_sglang_rule_on_eos_positions(script):
    """SGLang 0.5.23's kernel (EOS stored as is) over each request's whole sequence: our "rehash" ids
    everywhere; vLLM's "offset" ids differ exactly at EOS positions."""
    weights, sizes = SPEC.poly_weights(0).tolist(), SPEC.sizes(0).tolist()
    exclusive = np.append(SPEC.offsets(0).reshape(-1), SPEC.rows(0)).tolist()
    seqs = script["seqs"][:12]
    want = kernel_ids(4, 4, weights, sizes, exclusive, np.cumsum([0] + [len(s) for s in seqs]).tolist(), seqs,
                      list(range(len(seqs))), [0] * len(seqs), eos=EOS)
    tokens = np.concatenate(seqs)
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    got = row_ids_numpy(REHASH, 0, tokens, cu)
    np.testing.assert_array_equal(got, np.asarray(want))
    np.testing.assert_array_equal(row_ids_torch(REHASH, 0, tokens, cu).numpy(), got)
    vllm = row_ids_numpy(SPEC, 0, tokens, cu)
    eos = tokens == EOS
    assert (vllm[eos] == SPEC.offsets(0).reshape(-1)).all() and (got[eos] != vllm[eos]).all()
    np.testing.assert_array_equal(got[~eos], vllm[~eos])


def test_boundaries():
    off = SPEC.offsets(0).reshape(-1)
    sizes = SPEC.sizes(0).reshape(-1)
    toks = np.array([5, 9, EOS, 7, 8, EOS, 0, 3])
    ids = row_ids_numpy(SPEC, 0, toks)
    np.testing.assert_array_equal(ids[0], 5 % sizes + off)  # a request's first token: every order is a unigram
    np.testing.assert_array_equal(ids[2], off)  # an EOS current token: the table's first row
    np.testing.assert_array_equal(ids[3:5], row_ids_numpy(SPEC, 0, toks[3:5]))  # after an EOS: as a fresh start
    assert ids[1][4] == (9 + 5 * V) % sizes[4] + off[4]  # order 3 cut at the start: two tokens
    np.testing.assert_array_equal(row_ids_numpy(SPEC, 0, [3], history=[[8, -EOS, 0]])[0], ids[7])  # vLLM's context
    np.testing.assert_array_equal(row_ids_numpy(SPEC, 0, [3], history=[[-1, -1, 0]])[0], ids[7])
    with pytest.raises(InvalidRequest, match="token ids"):
        row_ids_numpy(SPEC, 0, [-1, 3])
    with pytest.raises(InvalidRequest, match="history"):
        row_ids_numpy(SPEC, 0, [3], history=[[V, 1, 1]])


# --------------------------------------------------------------------------- synth, verify, serve, hash
@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """A set written by ``engram-store synth --model longcat-flash-lite --scale 0.0005``, which verify accepts."""
    out = tmp_path_factory.mktemp("longcat") / "tables"
    for args in (["synth", "--model", NAME, "--scale", "0.0005", "--out", str(out)], ["verify", str(out)]):
        run = subprocess.run([sys.executable, "-m", "engram_store", *args], capture_output=True, text=True, cwd=REPO,
                             timeout=120)
        assert run.returncode == 0, run.stderr
    ts = TableSet.open(out)
    yield ts
    ts.close()


def test_daemon_serves_the_synthetic_rows(tables, reader_daemon):
    """Each reader of the conftest's ``reader_daemon`` (resident native and Python, cached) gives read_rows' bytes."""
    from engram_store.client.client import EngramClient
    from support.daemon_helpers import expected

    spec = tables.spec
    assert spec == get_spec(NAME, 0.0005) and tables.row_bytes == 512
    tokens = np.random.default_rng(1).integers(0, V, 300)
    tokens[::9] = EOS
    ids = row_ids_numpy(spec, 0, tokens, [0, 120, 300])
    assert ids.max() < spec.rows(0) and (ids[::9] == spec.offsets(0).reshape(-1)).all()
    with EngramClient.connect(reader_daemon.unix) as client:
        np.testing.assert_array_equal(client.lookup(0, ids), expected(tables, 0, ids))


def test_hash_command_prints_row_ids():
    cli = [sys.executable, "-m", "engram_store", "hash", "--model", NAME]
    run = subprocess.run(cli + ["--tokens", f"5,{EOS},7,8", "--history", "3,4"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["layer"] == 0
    assert got["rows"] == row_ids(SPEC, 0, [5, EOS, 7, 8], None, [[4, 3, -1]]).tolist()


@pytest.mark.parametrize("resident", [False, True])
def test_client_steps_fetch_the_rows_of_each_steps_ids(script, tables, resident):
    """The client's Step path over the script's steps (prefix-cached, resumed and preempted requests,
    EOS runs, mixed batches): the prefetcher rolls each request's lookback itself, given only at a
    request's (re)start, and fetches the rows of the ids hashed by position (the ids
    test_row_ids_equal_vllms_model_state finds equal to vLLM's) on the small set, by read_rows."""
    pytest.importorskip("torch")
    from gpu_client import EngramPrefetcher, LocalClient
    from gpu_client.step import Step

    seqs, spec, k, restarted, positions = script["seqs"], tables.spec, 0, set(), 0
    with EngramPrefetcher(LocalClient.open(tables.directory), device="cpu", max_tokens=1024, resident=resident,
                          raw_ids=True) as pf:
        for event in script["events"]:
            if event[0] == "add":  # the request (re)starts at position event[2]: the next step carries lookback
                restarted.add(event[4])
                continue
            rows = script["plan"][k]
            k += 1
            tokens = np.concatenate([seqs[r][s:s + n] for r, s, n in rows]).astype(np.int64)
            cu = np.concatenate([[0], np.cumsum([n for _, _, n in rows])])
            back = lookback(seqs, rows, spec.history_len)
            given = back if any(r in restarted for r, _, _ in rows) else None
            restarted -= {r for r, _, _ in rows}
            got = pf.submit(Step.of([r for r, _, _ in rows], tokens, cu, lookback=given)).wait(0).numpy()
            ids = row_ids(spec, 0, tokens, cu, back)
            want = tables.read_rows(0, ids.reshape(-1)).reshape(got.shape)
            np.testing.assert_array_equal(got, want, err_msg=f"step {k - 1}")
            positions += tokens.size
    assert k == len(script["plan"]) and positions > 3000
