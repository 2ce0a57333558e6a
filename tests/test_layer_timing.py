"""Layer-ahead timing: every layer's lookup leaves at once, and ``timings()`` tells, per layer, when the
rows landed against when the model asked (the ``wait`` call). Assertions are on structure and order
(which event came first), not on speed."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engram_store import get_spec
from gpu_client import EngramPrefetcher, Step
from gpu_client.timing import DEVICE_FIELDS, HOST_FIELDS

SPEC = get_spec("tiny")
FIRST, LAST = SPEC.layers[0], SPEC.layers[-1]


@pytest.fixture(scope="module")
def tables(tiny_tables):
    return tiny_tables(seed=17)


class GatedClient:
    """A LocalClient whose ``lookup_into`` records each call and can be held: ``barrier`` makes every
    layer's lookup wait until all of them have started; ``gates[layer]`` holds that layer's lookup."""

    def __init__(self, inner, barrier: threading.Barrier | None = None) -> None:
        self._inner = inner
        self.barrier = barrier
        self.gates: dict[int, threading.Event] = {}
        self.started: list[tuple[int, float]] = []
        self._lock = threading.Lock()

    def info(self):
        return self._inner.info()

    def lookup_into(self, layer, row_ids, out):
        with self._lock:
            self.started.append((layer, time.perf_counter()))
        if self.barrier is not None:
            self.barrier.wait()  # raises BrokenBarrierError if the layers' lookups are not in flight together
        gate = self.gates.get(layer)
        if gate is not None:
            gate.wait(30)
        return self._inner.lookup_into(layer, row_ids, out)


def _step(seed: int = 0, batch: int = 4) -> Step:
    rng = np.random.default_rng(seed)
    return Step.from_lists(range(batch), [rng.integers(0, SPEC.compressed_vocab, 3) for _ in range(batch)])


def test_every_layers_lookup_is_in_flight_before_the_first_layer_is_consumed(client):
    gated = GatedClient(client, threading.Barrier(len(SPEC.layers), timeout=30))
    with EngramPrefetcher(gated, device="cpu", max_tokens=64, resident=False) as pf:
        fut = pf.submit(_step())
        fut.wait(FIRST)  # returns only once every layer's lookup has started (the barrier)
        consumed = time.perf_counter()
        assert sorted(layer for layer, _ in gated.started) == sorted(SPEC.layers)
        assert all(t < consumed for _, t in gated.started)
        fut.wait_all()
        t = pf.timings()["layers"]
        # the first layer's rows could land only once every layer's lookup had left
        assert all(t[layer]["issued_ms"]["p50"] <= t[FIRST]["rows_ready_ms"]["p50"] for layer in SPEC.layers)


def test_a_layer_asked_late_was_ready_and_reports_its_slack(client):
    with EngramPrefetcher(client, device="cpu", max_tokens=64, resident=False) as pf:
        fut = pf.submit(_step(1))
        pf.drain()  # every layer has landed
        time.sleep(0.02)  # the layers before LAST "run"
        fut.wait(LAST)
        fut.wait(FIRST)
        doc = pf.timings()
        assert doc["window"] == 1024 and set(doc["layers"]) == set(SPEC.layers)
        last = doc["layers"][LAST]
        assert last["steps"] == 1 and last["late"] == 0
        assert set(HOST_FIELDS) <= set(last) and not set(DEVICE_FIELDS) & set(last)  # no device figures on CPU
        issued, ready, needed = (last[k]["p50"] for k in ("issued_ms", "rows_ready_ms", "needed_at_ms"))
        assert 0 <= issued <= ready <= needed and needed >= 20.0
        assert last["slack_ms"]["p50"] == pytest.approx(needed - ready, abs=1e-3)
        assert last["slack_ms"]["p50"] > 0 and last["waited_ms"]["p50"] >= 0
        assert doc["layers"][FIRST]["needed_at_ms"]["p50"] >= needed  # asked after LAST


def test_a_layer_whose_rows_are_late_reports_the_wait(client):
    gated = GatedClient(client)
    gated.gates[LAST] = threading.Event()
    with EngramPrefetcher(gated, device="cpu", max_tokens=64, resident=False) as pf:
        fut = pf.submit(_step(2))
        fut.wait(FIRST)
        threading.Timer(0.1, gated.gates[LAST].set).start()  # the rows land while the model waits
        fut.wait(LAST)
        last = pf.timings()["layers"][LAST]
        assert last["late"] == 1
        assert last["slack_ms"]["p50"] <= 0 <= last["waited_ms"]["p50"]
        assert last["rows_ready_ms"]["p50"] >= last["needed_at_ms"]["p50"]


def test_no_prefetch_fetches_at_the_wait(client):
    with EngramPrefetcher(client, device="cpu", max_tokens=64, resident=False, prefetch=False) as pf:
        for k in range(3):
            pf.submit(_step(k)).wait_all()
        for doc in pf.timings()["layers"].values():
            assert doc["steps"] == 3 and doc["late"] == 3  # the lookup itself starts when the model asks
            assert doc["issued_ms"]["p50"] >= doc["needed_at_ms"]["p50"] and doc["slack_ms"]["p99"] <= 0


def test_stats_are_rolling_counted_once_per_wait_and_resettable(client):
    with EngramPrefetcher(client, device="cpu", max_tokens=64, resident=True, timing_window=4) as pf:
        for k in range(10):
            fut = pf.submit(_step(k))
            fut.wait_all()
            fut.wait(FIRST)  # a second wait of a layer is not a second sample
        assert all(len(s.host) == 4 for s in pf._timing._stats)  # bounded memory
        doc = pf.timings(reset=True)
        assert all(d["steps"] == 10 for d in doc["layers"].values()) and doc["window"] == 4
        assert all(d["steps"] == 0 for d in pf.timings()["layers"].values())
    with EngramPrefetcher(client, device="cpu", max_tokens=64, resident=False, timing=False) as pf:
        pf.submit(_step()).wait_all()
        assert all(d["steps"] == 0 for d in pf.timings()["layers"].values())


def test_prefetcher_level_wait_is_timed_too(client):
    with EngramPrefetcher(client, device="cpu", max_tokens=64, resident=False, depth=3) as pf:
        pf.submit(_step(1))
        pf.submit(_step(2))
        for _ in range(2):
            for layer in SPEC.layers:
                pf.wait(layer)
        assert all(d["steps"] == 2 for d in pf.timings()["layers"].values())
