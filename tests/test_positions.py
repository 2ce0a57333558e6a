"""Row ids by position: the stateless ``row_ids(tokens, cu_seqlens, lookback)`` against vLLM 0.33's own
``_hash_ids_kernel``, and the prefetcher's per-request history (prefix-cache start, chunked prefill with
lookback, speculative rollback, preemption, advance) against one prefill of the same tokens."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

from engram_store.errors import InvalidRequest
from engram_store.format.tableset import TableSet
from engram_store.models.hashing import row_ids, row_ids_numpy, row_ids_torch
from engram_store.models.spec import get_spec
from engram_store.models.tokens import RawIds, TokenMap
from engram_store.tools.synth import write_synthetic

V41_SMALL = get_spec("deepseek-v4.1-flash", 0.0005)  # V4.1's hash, small primes


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_stateless_row_ids_equal_vllms_kernel(tmp_path):
    from support.vllm_engram_ref import IMAGE_ID, cases, reference

    ref = reference(V41_SMALL, tmp_path)
    np.testing.assert_array_equal(ref["primes"].reshape(len(V41_SMALL.layers), -1),
                                  np.stack([V41_SMALL.primes(layer).reshape(-1) for layer in V41_SMALL.layers]))
    for li, layer in enumerate(V41_SMALL.layers):
        assert tuple(int(m) for m in ref["multipliers"][li]) == V41_SMALL.multipliers[layer]
    raw = RawIds(TokenMap.from_array(ref["token_map"], int(ref["classes"])), IMAGE_ID, True, 2)
    for i, case in enumerate(cases(V41_SMALL)):
        for li, layer in enumerate(V41_SMALL.layers):
            ours = row_ids(V41_SMALL, layer, case["tokens"], case["cu"], case["lookback"], raw=raw)
            np.testing.assert_array_equal(ours, ref[f"c{i}_rows"][:, li, :], err_msg=f"case {i} layer {layer}")
            twin = row_ids_torch(V41_SMALL, layer, case["tokens"], case["cu"], lookback=case["lookback"], raw=raw)
            np.testing.assert_array_equal(twin.numpy(), ours)


def test_lookback_minus_one_is_pad_and_image_blocks_older():
    spec, layer = get_spec("tiny"), 1
    pad = spec.pad_id
    # lookback [-1, 17, 5]: position start-1 unknown (pad), the older ones still count (vLLM)
    np.testing.assert_array_equal(row_ids(spec, layer, [9], None, [[-1, 17, 5]]),
                                  row_ids_numpy(spec, layer, [9], None, [[5, 17, pad]]))
    tm = TokenMap.from_array(np.arange(600) % spec.compressed_vocab, spec.compressed_vocab)
    raw = RawIds(tm, image_token_id=599, block_images=True)
    np.testing.assert_array_equal(row_ids(spec, layer, [9], None, [[4, 599, 5]], raw=raw),
                                  row_ids_numpy(spec, layer, [9], None, [[-1, -1, 4]]))
    unblocked = RawIds(tm, image_token_id=599, block_images=False)
    np.testing.assert_array_equal(row_ids(spec, layer, [9], None, [[4, 599, 5]], raw=unblocked),
                                  row_ids_numpy(spec, layer, [9], None, [[5, 599 % 512, 4]]))


# --------------------------------------------------------------------------- the prefetcher's history
IMAGE = 2999
SPEC = dataclasses.replace(get_spec("tiny"), pad_token_id=2, image_token_id=IMAGE)


def _map() -> TokenMap:
    ids = np.random.default_rng(4).integers(0, SPEC.compressed_vocab, 3000)
    ids[: SPEC.compressed_vocab] = np.arange(SPEC.compressed_vocab)  # every class used; raw pad 2 -> 2
    return TokenMap.from_array(ids, SPEC.compressed_vocab)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    path = tmp_path_factory.mktemp("positions") / "tiny"
    write_synthetic(path, SPEC, seed=21)
    ts = TableSet.open(path)
    yield path, ts
    ts.close()


@pytest.fixture
def pf(client):
    from gpu_client import EngramPrefetcher

    p = EngramPrefetcher(client, "cpu", max_tokens=256, raw_ids=True, token_map=_map(), max_rollback=4)
    yield p
    p.close()


RAW = RawIds(_map(), IMAGE, True, 2)
rng = np.random.default_rng(8)
PROMPT = rng.integers(0, 3000, 40)
PROMPT[[7, 8, 20]] = IMAGE


def truth(tables, seq, positions, layer):
    """Rows of ``positions`` of a single prefill of ``seq`` (raw ids)."""
    ids = row_ids_numpy(SPEC, layer, seq, raw=RAW)[positions]
    return tables[1].read_rows(layer, ids).reshape(len(positions), SPEC.rows_per_token, SPEC.row_bytes)


def rows(fut, layer):
    return fut.wait(layer).numpy().copy()


def check(pf, tables, step, seq, positions):
    from gpu_client import Step

    fut = pf.submit(Step.from_lists(*step) if isinstance(step, tuple) else step)
    for layer in SPEC.layers:
        np.testing.assert_array_equal(rows(fut, layer), truth(tables, seq, positions, layer))


def test_prefix_cache_start(pf, tables):
    seq = np.array([5, 17, 923, 4, 8])
    pf.start("r", 3, [923, 17, 5])  # 3 tokens cached: positions 3-4 hash with lookback [923, 17, 5]
    check(pf, tables, (["r"], [[4, 8]]), seq, [3, 4])
    check(pf, tables, (["r"], [[11]]), np.append(seq, 11), [5])  # and decode goes on from there
    pf.start("early", 1, [5, 77, 99])  # position 1: only the newest lookback id exists
    check(pf, tables, (["early"], [[17, 923]]), seq, [1, 2])


def test_chunked_prefill_with_lookback(pf, tables):
    from gpu_client import Step

    for lo, hi in ((0, 13), (13, 21), (21, 40)):  # each chunk stateless: its tokens and the 3 before
        lookback = [PROMPT[p] if p >= 0 else -1 for p in range(lo - 1, lo - 4, -1)]
        step = Step.from_lists(["c"], [PROMPT[lo:hi]], lookback=[lookback])
        check(pf, tables, step, PROMPT, list(range(lo, hi)))
    check(pf, tables, (["c"], [[6]]), np.append(PROMPT, 6), [40])  # the history was kept after the chunks
    step = Step.from_lists(["fresh"], [PROMPT[26:34]], lookback=[PROMPT[25:22:-1]])  # no history: lookback only
    check(pf, tables, step, PROMPT, list(range(26, 34)))


def test_speculative_rollback(pf, tables):
    check(pf, tables, (["s"], [PROMPT[:30]]), PROMPT, list(range(30)))
    check(pf, tables, (["o"], [PROMPT[:5]]), PROMPT, list(range(5)))
    drafts = [PROMPT[30], 111, 222, 333]  # verify step: the last sampled token and 3 drafts
    check(pf, tables, (["s"], [drafts]), np.concatenate([PROMPT[:30], drafts]), list(range(30, 34)))
    pf.rollback("s", 2)  # 1 of 3 drafts accepted
    seq = np.concatenate([PROMPT[:31], [111, 444]])
    check(pf, tables, (["s"], [[444]]), seq, [32])
    with pytest.raises(InvalidRequest, match="max_rollback"):
        pf.rollback("s", 4 + 1)
    with pytest.raises(InvalidRequest, match="position"):
        pf.rollback("o", 6)


def test_preemption_and_resume(pf, tables):
    check(pf, tables, (["p"], [PROMPT[:25]]), PROMPT, list(range(25)))
    pf.forget(["p"])  # preempted: recomputed from scratch later
    check(pf, tables, (["p"], [PROMPT[:30]]), PROMPT, list(range(30)))
    pf.forget(["p"])  # preempted again, resumed on a prefix-cache hit of 30 tokens
    pf.start("p", 30, PROMPT[29:26:-1])
    check(pf, tables, (["p"], [PROMPT[30:]]), PROMPT, list(range(30, 40)))


def test_advance_appends_without_hashing(pf, tables):
    check(pf, tables, (["a"], [PROMPT[:10]]), PROMPT, list(range(10)))
    pf.advance("a", PROMPT[10:12])
    check(pf, tables, (["a"], [PROMPT[12:14]]), PROMPT, [12, 13])


def test_raw_ids_out_of_range_and_compressed_steps_without_the_flag(pf, client):
    from gpu_client import EngramPrefetcher, Step

    with pytest.raises(InvalidRequest, match="raw ids"):
        pf.submit(Step.from_lists(["x"], [[3000]]))
    with EngramPrefetcher(client, "cpu", max_tokens=16) as plain:  # compressed ids stay accepted
        with pytest.raises(InvalidRequest, match="raw_ids=True"):
            plain.submit(Step.from_lists(["x"], [[600]]))
    with pytest.raises(InvalidRequest, match="token map"):
        EngramPrefetcher(client, "cpu", max_tokens=16, raw_ids=True)  # LocalClient's Info names no map
