"""Row-id hashing: numpy against a plain scalar transcription of the recipe, torch against numpy."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from engram_store.errors import InvalidRequest
from engram_store.models.hashing import next_history_numpy, next_history_torch, row_ids_numpy, row_ids_torch
from engram_store.models.spec import get_spec

V41 = get_spec("deepseek-v4.1-flash")


def scalar_rows(spec, layer, seq, history, t):
    """The recipe of shared/ENGRAM.md for one position, in plain Python ints."""
    full = list(history) + list(seq)
    at = len(history) + t
    tok, blocked = [], False
    for k in range(spec.max_ngram):
        x = full[at - k] if at - k >= 0 else spec.pad_id
        blocked = blocked or x == -1
        tok.append(spec.pad_id if blocked else x)
    m = spec.multipliers[layer]
    primes = spec.primes(layer)
    offsets = spec.offsets(layer)
    rows, mix = [], tok[0] * m[0]
    for n in range(2, spec.max_ngram + 1):
        mix ^= tok[n - 1] * m[n - 1]
        if n in spec.orders:
            oi = spec.orders.index(n)
            rows += [mix % int(primes[oi, j]) + int(offsets[oi, j]) for j in range(spec.heads)]
    return rows


def random_batch(spec, rng, n_req, max_len, p_blocked=0.05):
    lengths = rng.integers(0, max_len, n_req)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0, spec.compressed_vocab, cu[-1])
    tokens[rng.random(tokens.size) < p_blocked] = -1
    history = rng.integers(0, spec.compressed_vocab, (n_req, spec.history_len))
    history[rng.random(history.shape) < 0.3] = spec.pad_id
    history[rng.random(history.shape) < p_blocked] = -1
    return tokens, cu, history


@pytest.mark.parametrize("name,layer", [("deepseek-v4.1-flash", 1), ("deepseek-v4.1-flash", 14), ("engram-27b", 15), ("tiny", 3)])
def test_numpy_matches_scalar_recipe(name, layer):
    spec = get_spec(name)
    tokens, cu, history = random_batch(spec, np.random.default_rng(layer), 6, 40)
    got = row_ids_numpy(spec, layer, tokens, cu, history)
    want = [scalar_rows(spec, layer, tokens[cu[b]:cu[b + 1]], history[b], t)
            for b in range(len(cu) - 1) for t in range(cu[b + 1] - cu[b])]
    assert got.dtype == np.int64 and got.shape == (cu[-1], spec.rows_per_token)
    assert got.tolist() == want
    assert (got >= 0).all() and (got < spec.rows(layer)).all()


def test_torch_matches_numpy_on_100k_positions():
    rng = np.random.default_rng(7)
    tokens, cu, history = random_batch(V41, rng, 37, 5400)
    assert cu[-1] > 100_000
    for layer in V41.layers:
        want = row_ids_numpy(V41, layer, tokens, cu, history)
        got = row_ids_torch(V41, layer, torch.from_numpy(tokens), torch.from_numpy(cu), torch.from_numpy(history))
        assert got.dtype == torch.int64 and torch.equal(got, torch.from_numpy(want))
    assert torch.equal(next_history_torch(V41, torch.from_numpy(tokens), torch.from_numpy(cu), torch.from_numpy(history)),
                       torch.from_numpy(next_history_numpy(V41, tokens, cu, history)))


@pytest.mark.parametrize("impl", ["numpy", "torch"])
def test_decode_with_history_equals_prefill(impl):
    rows = row_ids_numpy if impl == "numpy" else (lambda *a: row_ids_torch(*a).numpy())
    nxt = next_history_numpy if impl == "numpy" else (lambda *a: next_history_torch(*a).numpy())
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, V41.compressed_vocab, n) for n in (9, 1, 5)]
    seqs[0][4] = -1  # an image token inside the first request
    prefill_cu = np.array([0, 9, 10, 15])
    full = np.concatenate(seqs)
    want = row_ids_numpy(V41, 14, full, prefill_cu)
    # The same requests, chunked: first 3 (or fewer) tokens of each as a prefill, then one decode step at a time.
    history = np.full((3, V41.history_len), V41.pad_id)
    got = {b: [] for b in range(3)}
    pos = [0, 0, 0]
    while any(pos[b] < len(seqs[b]) for b in range(3)):
        take = [min(len(seqs[b]) - pos[b], 3 if pos[b] == 0 else 1) for b in range(3)]
        step = np.concatenate([seqs[b][pos[b]:pos[b] + take[b]] for b in range(3)])
        cu = np.concatenate([[0], np.cumsum(take)])
        out = rows(V41, 14, step, cu, history)
        for b in range(3):
            got[b].append(out[cu[b]:cu[b + 1]])
            pos[b] += take[b]
        history = nxt(V41, step, cu, history)
    assert np.array_equal(np.concatenate([np.concatenate(got[b]) for b in range(3)]), want)


def test_blocked_token_pads_itself_and_everything_older():
    spec = get_spec("tiny")
    seq = np.array([10, 11, -1, 12, 13, 14])
    got = row_ids_numpy(spec, 1, seq)
    # Position 4 (token 13) sees [13, 12, pad, pad]: same as a fresh request "12, 13".
    assert np.array_equal(got[4], row_ids_numpy(spec, 1, [12, 13])[1])
    # The blocked position itself hashes as an all-pad suffix.
    assert np.array_equal(got[2], row_ids_numpy(spec, 1, [spec.pad_id])[0])


def test_bad_batches_are_refused():
    spec = get_spec("tiny")
    with pytest.raises(InvalidRequest, match="compressed ids"):
        row_ids_numpy(spec, 1, [spec.compressed_vocab])
    with pytest.raises(InvalidRequest, match="compressed ids"):
        row_ids_torch(spec, 1, torch.tensor([-2]))
    with pytest.raises(InvalidRequest, match="cu_seqlens"):
        row_ids_numpy(spec, 1, [1, 2, 3], [0, 2])
    with pytest.raises(InvalidRequest, match="history must have shape"):
        row_ids_numpy(spec, 1, [1, 2], [0, 2], np.zeros((1, 2), dtype=np.int64))


def test_cli_hash_prints_row_ids():
    out = subprocess.run([sys.executable, "-m", "engram_store", "hash", "--layer", "14", "--tokens", "5,17,9",
                          "--history", "2,2,4"], check=True, capture_output=True, text=True).stdout
    doc = json.loads(out)
    assert doc["layer"] == 14
    assert doc["rows"] == [scalar_rows(V41, 14, [5, 17, 9], [2, 2, 4], t) for t in range(3)]
