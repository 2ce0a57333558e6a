"""EngramPrefetcher on CPU: rows byte-exact against the reference reader (TableSet.read_rows).

The expected row ids of a position are computed by hashing the request's whole
token sequence so far in one go (no history), so the prefetcher's per-request
history bookkeeping is checked against an independent computation.
"""

from __future__ import annotations

import numpy as np
import pytest

from engram_store import TableSet, TieredStore, get_spec
from engram_store.errors import InvalidRequest, ResourceExhausted, StorageError
from engram_store.models.hashing import row_ids_numpy
from gpu_client import EngramPrefetcher, LocalClient, Step

SPEC = get_spec("tiny")
PATHS = {  # name -> EngramPrefetcher keyword arguments
    "staged": dict(resident=False),
    "resident": dict(resident=True),
    "lazy": dict(resident=False, prefetch=False),
    "depth3": dict(resident=False, depth=3),
}


@pytest.fixture(scope="module")
def tables(tiny_tables):
    return tiny_tables(seed=7)


@pytest.fixture(params=sorted(PATHS))
def prefetcher(request, client):
    pf = EngramPrefetcher(client, device="cpu", max_tokens=256, **PATHS[request.param])
    yield pf
    pf.close()


class Reference:
    """Each request's full token sequence; expected rows of a step from hashing whole sequences."""

    def __init__(self, ts: TableSet) -> None:
        self.ts = ts
        self.seqs: dict[object, list[int]] = {}

    def step(self, step: Step) -> dict[int, np.ndarray]:
        parts = {layer: [] for layer in SPEC.layers}
        for b, rid in enumerate(step.request_ids):
            new = step.tokens[step.cu_seqlens[b]: step.cu_seqlens[b + 1]].tolist()
            seq = self.seqs.setdefault(rid, [])
            seq.extend(new)
            for layer in SPEC.layers:
                ids = row_ids_numpy(SPEC, layer, np.asarray(seq, dtype=np.int64))[len(seq) - len(new):]
                parts[layer].append(self.ts.read_rows(layer, ids).reshape(len(new), SPEC.rows_per_token, SPEC.row_bytes))
        for rid in step.finished:
            self.seqs.pop(rid, None)
        return {layer: np.concatenate(p) if p else np.zeros((0, SPEC.rows_per_token, SPEC.row_bytes), np.uint8)
                for layer, p in parts.items()}


def check(fut, expected) -> None:
    for layer, want in expected.items():
        got = fut.wait(layer).numpy()
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("resident, path", [(None, "resident-cpu"), (True, "resident-cpu"), (False, "staged")])
def test_path_is_chosen_and_reported(client, resident, path):
    with EngramPrefetcher(client, resident=resident, max_tokens=8) as pf:
        assert pf.path == path and pf.info()["path"] == path


def test_info(prefetcher):
    info = prefetcher.info()
    assert info["layers"] == list(SPEC.layers)
    assert info["rows_per_token"] == SPEC.rows_per_token and info["row_bytes"] == SPEC.row_bytes


def test_prefill_chunks_then_decode(prefetcher, tables):
    ref = Reference(tables[1])
    rng = np.random.default_rng(1)
    seq = rng.integers(0, SPEC.compressed_vocab, size=30)
    steps = [Step.from_lists(["r"], [seq[:7]]), Step.from_lists(["r"], [seq[7:9]]),
             Step.from_lists(["r"], [seq[9:20]])]
    steps += [Step.decode(["r"], [t]) for t in seq[20:]]
    for step in steps:
        check(prefetcher.submit(step), ref.step(step))


def test_decode_differs_from_fresh_request(prefetcher, tables):
    """History matters: a decode token hashes unlike the same token starting a new request."""
    prefetcher.submit(Step.from_lists(["old"], [[11, 12, 13]])).wait_all()
    with_history = prefetcher.submit(Step.decode(["old", "new"], [14, 14]))
    rows = with_history.wait(SPEC.layers[0]).numpy()
    assert not np.array_equal(rows[0], rows[1])


def test_concurrent_requests_with_churn_and_blocked_tokens(prefetcher, tables):
    ref = Reference(tables[1])
    rng = np.random.default_rng(2)
    active: list[int] = []
    next_id = 0
    for _ in range(40):
        while len(active) < 6:
            active.append(next_id)
            next_id += 1
        batch = [r for r in active if rng.random() < 0.8]
        lengths = [int(rng.integers(0, 9)) if r not in ref.seqs else int(rng.integers(0, 3)) for r in batch]
        toks = [rng.integers(0, SPEC.compressed_vocab, size=n) for n in lengths]
        for t in toks:
            t[rng.random(t.size) < 0.1] = -1  # blocked positions (an image span)
        finished = [r for r in batch if rng.random() < 0.2]
        if active and rng.random() < 0.1:
            finished.append(active[0])  # finished while not scheduled this step
        step = Step.from_lists(batch, toks, finished=sorted(set(finished)))
        check(prefetcher.submit(step), ref.step(step))
        active = [r for r in active if r not in step.finished]
    assert prefetcher.active_requests == len(ref.seqs)


def test_overlapped_steps_keep_their_rows(prefetcher, tables):
    """Submit step k+1 before consuming step k (double buffering); both stay intact."""
    ref = Reference(tables[1])
    rng = np.random.default_rng(3)
    ids = list(range(5))
    steps = [Step.from_lists(ids, [rng.integers(0, SPEC.compressed_vocab, size=4) for _ in ids])]
    steps += [Step.decode(ids, rng.integers(0, SPEC.compressed_vocab, size=len(ids))) for _ in range(6)]
    expected = [ref.step(s) for s in steps]
    futs = [prefetcher.submit(steps[0])]
    for k in range(len(steps)):
        if k + 1 < len(steps):
            futs.append(prefetcher.submit(steps[k + 1]))
        for layer in SPEC.layers:  # the prefetcher-level wait serves the oldest step first
            np.testing.assert_array_equal(prefetcher.wait(layer).numpy(), expected[k][layer])


def test_wait_all_then_buffers_and_counts(prefetcher, tables):
    step = Step.from_lists(["x", "y"], [[1, 2, 3], [4, 5]])
    fut = prefetcher.submit(step)
    want = Reference(tables[1]).step(step)
    fut.wait_all()
    assert fut.done()
    for layer in SPEC.layers:
        buf = prefetcher.buffer(fut.slot, layer)
        assert tuple(buf.shape) == (256, SPEC.rows_per_token, SPEC.row_bytes)
        np.testing.assert_array_equal(buf[: fut.num_tokens].numpy(), want[layer])
    assert int(prefetcher.token_count(fut.slot)) == 5


def test_finished_request_id_can_be_reused(prefetcher, tables):
    ref = Reference(tables[1])
    for step in (Step.from_lists(["a"], [[40, 41, 42]], finished=["a"]), Step.from_lists(["a"], [[43, 44]])):
        check(prefetcher.submit(step), ref.step(step))
    prefetcher.forget(["a"])
    assert prefetcher.active_requests == 0


def test_bad_input_is_rejected(prefetcher):
    with pytest.raises(ResourceExhausted):
        prefetcher.submit(Step.from_lists(["a"], [np.zeros(257, dtype=np.int64)]))
    with pytest.raises(InvalidRequest):
        prefetcher.submit(Step.from_lists(["a"], [[SPEC.compressed_vocab]]))
    with pytest.raises(InvalidRequest):
        prefetcher.submit(Step.from_lists(["a"], [[-2]]))
    with pytest.raises(InvalidRequest):
        Step.from_lists(["a", "a"], [[1], [2]])
    with pytest.raises(InvalidRequest):
        Step.of(["a"], [1, 2], [0, 3])
    fut = prefetcher.submit(Step.decode(["a"], [1]))
    with pytest.raises(InvalidRequest):
        fut.wait(SPEC.layers[-1] + 1)
    assert prefetcher.active_requests == 1  # rejected steps left no history behind


class FailingClient:
    """A client whose lookups fail like a broken NVMe tier."""

    def __init__(self, inner: LocalClient) -> None:
        self.inner = inner

    def info(self):
        return self.inner.info()

    def lookup_into(self, layer, row_ids, out):
        raise StorageError(f"layer {layer}: simulated read error")


@pytest.mark.parametrize("prefetch", [True, False])
def test_lookup_errors_reach_the_waiter(client, prefetch):
    with EngramPrefetcher(FailingClient(client), prefetch=prefetch, max_tokens=16) as pf:
        assert pf.path == "staged"
        fut = pf.submit(Step.decode(["a"], [3]))
        with pytest.raises(StorageError, match="simulated"):
            fut.wait(SPEC.layers[0])
        pf.submit(Step.decode(["a"], [4]))  # later steps still go through
        pf.submit(Step.decode(["a"], [5]))


def test_resident_required_without_arena(client):
    with pytest.raises(StorageError):
        EngramPrefetcher(FailingClient(client), resident=True)


@pytest.mark.parametrize("mode", ["cached", "resident"])
def test_over_the_tiered_store(tables, mode):
    """The daemon's engine in process: cached mode reads cold rows from the NVMe tier in the background thread."""
    ref = Reference(tables[1])
    rng = np.random.default_rng(4)
    with LocalClient(TieredStore.open(tables[0], dram_bytes=16 << 20, mode=mode)) as client:
        with EngramPrefetcher(client, max_tokens=64) as pf:
            assert pf.path == ("resident-cpu" if mode == "resident" else "staged")
            ids = list(range(4))
            steps = [Step.from_lists(ids, [rng.integers(0, SPEC.compressed_vocab, size=9) for _ in ids])]
            steps += [Step.decode(ids, rng.integers(0, SPEC.compressed_vocab, size=4)) for _ in range(3)]
            for step in steps:
                check(pf.submit(step), ref.step(step))


def test_empty_step_and_empty_requests(prefetcher, tables):
    ref = Reference(tables[1])
    for step in (Step.from_lists([], []), Step.from_lists(["a", "b"], [[], [3, 4]]), Step.from_lists(["a"], [[]]),
                 Step.decode(["a", "b"], [5, 6])):
        check(prefetcher.submit(step), ref.step(step))
