"""The client's Step path for Qwen3.8-Flash-Next: the prefetcher hashes raw token ids with the EOS boundary, 16
ids a token for its one PLE layer, and the rows it fetches are those of vLLM 0.33's own ids (``ple_ngram_ids``
under TRITON_INTERPRET, run by tests/support/vllm_qwen4exp_ref.py) over prefill chunks, decode steps, a finished
request and a restart with lookback, read with ``TableSet.read_rows``."""

from __future__ import annotations

import numpy as np
import pytest
from support.qwen4exp_reference import vllm_reference

from engram_store.errors import InvalidRequest
from engram_store.format.tableset import TableSet
from engram_store.models.qwen4exp import EOS
from engram_store.models.spec import get_spec
from engram_store.tools.synth import write_synthetic

SPEC = get_spec("qwen3.8-flash-next", 0.0002)
LAYER = 1


def _script(rng: np.random.Generator) -> tuple[list, dict]:
    """Steps as an engine submits them, and per step vLLM's view of it: the chunk of every request,
    ``query_start_loc`` and ``ngram_context`` (the 2 tokens before the chunk, EOS before the start)."""
    from gpu_client.step import Step

    seqs: dict[str, np.ndarray] = {}
    for rid in "abcde":
        seq = rng.integers(0, SPEC.compressed_vocab, 120)
        seq[rng.random(seq.size) < 0.1] = EOS
        seqs[rid] = seq
    seqs["c"][3:6] = EOS  # a run of EOS inside the first chunk
    seqs["d"][0] = EOS  # a request that starts with EOS
    done = {rid: 0 for rid in seqs}
    steps, cases = [], {}

    def add(step, rids, starts):
        i = len(steps)
        chunks = [seqs[r][s: s + n] for r, s, n in zip(rids, starts, np.diff(step.cu_seqlens))]
        ctx = [[seqs[r][p] if p >= 0 else EOS for p in (s - 2, s - 1)] for r, s in zip(rids, starts)]
        cases.update({f"c{i}_tokens": np.concatenate(chunks), f"c{i}_qsl": np.asarray(step.cu_seqlens),
                      f"c{i}_ctx": np.asarray(ctx, dtype=np.int64)})
        steps.append(step)

    def chunk(rids, lengths, finished=()):
        starts = [done[r] for r in rids]
        for r, n in zip(rids, lengths):
            done[r] += n
        add(Step.from_lists(list(rids), [seqs[r][done[r] - n: done[r]].tolist() for r, n in zip(rids, lengths)],
                            finished=list(finished)), rids, starts)

    chunk("abc", [17, 1, 40])  # prefill
    chunk("abcd", [9, 30, 2, 25])  # the next chunks of a, b, c and d's first
    for k in range(4):  # decode; b finishes after its second decode step
        rids = "abcd" if k < 2 else "acd"
        chunk(rids, [1] * len(rids), finished="b" if k == 1 else ())
    start = 50  # e resumes at position 50 (a prefix-cache hit): the step carries every request's lookback
    lookback = np.asarray([[seqs[r][p - 1 - j] for j in range(SPEC.history_len)] for r, p in (("e", start),
                                                                                            ("a", done["a"]))])
    step = Step.of(["e", "a"], np.concatenate([seqs["e"][start: start + 6], seqs["a"][done["a"]: done["a"] + 1]]),
                   np.asarray([0, 6, 7]), lookback=lookback)
    add(step, "ea", [start, done["a"]])
    return steps, cases


@pytest.fixture(scope="module")
def script():
    return _script(np.random.default_rng(3939))


@pytest.fixture(scope="module")
def vllm_ids(script, tmp_path_factory):
    got = vllm_reference(tmp_path_factory.mktemp("qwen-step-ref"), SPEC, [SPEC.table_base], [0], EOS, **script[1])
    return [got[f"c{i}_triton"] for i in range(len(script[0]))]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen-tables") / "t"
    write_synthetic(out, SPEC, seed=5)
    return out


@pytest.mark.parametrize("resident", [False, True])
@pytest.mark.parametrize("raw_ids", [False, True])
def test_steps_fetch_the_rows_of_vllms_ids(script, vllm_ids, tables, resident, raw_ids):
    pytest.importorskip("torch")
    from gpu_client import EngramPrefetcher, LocalClient

    ts = TableSet.open(tables)
    steps, _ = script
    positions = 0
    with EngramPrefetcher(LocalClient.open(tables), device="cpu", max_tokens=128, resident=resident,
                          raw_ids=raw_ids) as pf:
        for i, (step, ids) in enumerate(zip(steps, vllm_ids)):
            assert ids.shape == (step.num_tokens, 16)
            rows = pf.submit(step).wait(LAYER).numpy()
            want = ts.read_rows(LAYER, ids.reshape(-1)).reshape(step.num_tokens, 16, SPEC.row_bytes)
            np.testing.assert_array_equal(rows, want, err_msg=f"step {i}")
            positions += step.num_tokens
    assert positions > 100


def test_a_step_refuses_ids_outside_the_vocab(tables):
    pytest.importorskip("torch")
    from gpu_client import EngramPrefetcher, LocalClient
    from gpu_client.step import Step

    with EngramPrefetcher(LocalClient.open(tables), device="cpu", max_tokens=16) as pf:
        for bad in (-1, SPEC.compressed_vocab):  # Qwen has no blocked id: -1 is no token
            with pytest.raises(InvalidRequest, match="248320"):
                pf.submit(Step.from_lists(["x"], [[5, bad]]))
