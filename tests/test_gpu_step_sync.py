"""The step path never waits for the device: no readbacks, no pageable host-to-device copies.

On CUDA a readback (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, a Python branch on a
device value, ``nonzero``) blocks the engine thread until the GPU has caught up, and so does a
copy from pageable memory, ``non_blocking`` or not; either in ``submit()`` would undo the
layer-ahead overlap. Without a GPU this is checked two ways:

* on the ``meta`` device, where every readback raises (a meta tensor has no data), the whole
  submit path runs: prefill, decode, lookback, raw ids, start / advance / rollback;
* on CPU with a real prefetcher, hooks count readbacks, tensors made from host data (the pageable
  sources), advanced-index stores of a Python scalar (a hidden host-to-device copy on CUDA) and
  staging buffers made, on the engine thread during ``submit()`` of decode steps.
(``bench/device_check.py`` runs the same submits under ``torch.cuda.set_sync_debug_mode("error")``.)
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from engram_store import get_spec
from engram_store.models.tokens import TokenMap
from gpu_client import EngramPrefetcher, Step
from gpu_client.step_inputs import StepInputs

SPEC = get_spec("tiny")


@pytest.fixture(scope="module")
def tables(tiny_tables):
    return tiny_tables(seed=13)


def _decode_steps(n: int, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(batch)]
    yield Step.from_lists(ids, [rng.integers(0, SPEC.compressed_vocab, 5) for _ in ids])  # prefill first
    for _ in range(n):
        yield Step.decode(ids, rng.integers(0, SPEC.compressed_vocab, batch))


# --------------------------------------------------------------------------- meta: readbacks raise
def test_submit_path_runs_on_the_meta_device(client):
    """Any readback of a device value on the step path raises on ``meta``; none may be there."""
    with EngramPrefetcher(client, device="meta", max_tokens=64, resident=False, prefetch=False) as pf:
        for step in _decode_steps(3, batch=4, seed=1):
            fut = pf.submit(step)
        assert fut._ids[0].device.type == "meta" and fut._ids[0].shape == (4 * SPEC.rows_per_token,)
        pf.submit(Step.from_lists(["r0", "new"], [[1, 2], [3]], lookback=[[4, -1, 5], [-1, -1, -1]]))
        pf.start("s", position=9, lookback=[7, 8, 9])
        pf.advance("s", [10, 11])
        pf.rollback("s", 1)
        pf.submit(Step.decode(["s", "r1"], [12, 13], finished=["s"]))


def test_raw_ids_submit_path_runs_on_the_meta_device(client):
    ids = np.random.default_rng(4).integers(0, SPEC.compressed_vocab, 3000)
    ids[: SPEC.compressed_vocab] = np.arange(SPEC.compressed_vocab)
    spec = dataclasses.replace(SPEC, pad_token_id=2, image_token_id=2999)
    tm = TokenMap.from_array(ids, spec.compressed_vocab)
    with EngramPrefetcher(client, device="meta", max_tokens=64, resident=False, prefetch=False, raw_ids=True,
                          token_map=tm) as pf:
        pf.submit(Step.from_lists(["a", "b"], [[5, 2999, 7], [1500]]))
        pf.submit(Step.decode(["a", "b"], [2999, 2998]))
        pf.submit(Step.from_lists(["a"], [[9]], lookback=[[2999, 1, 2]]))


# --------------------------------------------------------------------------- CPU: hooks on the engine thread
class SyncGuard:
    """Counts, on the thread that made it and while ``active``, calls that would wait for a CUDA device."""

    READBACKS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__",
                 "__array__")
    HOST_DATA = ("from_numpy", "tensor", "as_tensor", "frombuffer", "asarray")

    def __init__(self, monkeypatch) -> None:
        self.thread = threading.get_ident()
        self.active = False
        self.calls: list[str] = []
        for name in self.READBACKS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), f"Tensor.{name}"))
        monkeypatch.setattr(torch, "nonzero", self._wrap(torch.nonzero, "torch.nonzero"))
        for name in self.HOST_DATA:  # a tensor made from host data here is a pageable copy source
            real = getattr(torch, name)
            monkeypatch.setattr(torch, name, self._wrap(real, f"torch.{name}",
                                                        lambda a, k: not (a and isinstance(a[0], torch.Tensor))))
        real_setitem = torch.Tensor.__setitem__

        def setitem(t, key, value):
            keys = key if isinstance(key, tuple) else (key,)
            if self._watching() and isinstance(value, (int, float, bool)) and \
                    any(isinstance(k, torch.Tensor) for k in keys):
                self.calls.append("tensor[index] = python scalar")  # CUDA: a blocking copy of the scalar
            return real_setitem(t, key, value)

        monkeypatch.setattr(torch.Tensor, "__setitem__", setitem)

    def _watching(self) -> bool:
        return self.active and threading.get_ident() == self.thread

    def _wrap(self, real, label, when=lambda a, k: True):
        def hooked(*args, **kwargs):
            if self._watching() and when(args, kwargs):
                self.calls.append(label)
            return real(*args, **kwargs)
        return hooked


@pytest.mark.parametrize("kwargs", [dict(resident=False), dict(resident=True), dict(resident=False, prefetch=False),
                                    dict(resident=False, depth=3)], ids=["staged", "resident", "lazy", "depth3"])
def test_decode_submit_reads_nothing_back_and_reuses_staging(client, monkeypatch, kwargs):
    with EngramPrefetcher(client, device="cpu", max_tokens=256, **kwargs) as pf:
        steps = list(_decode_steps(10, batch=16, seed=2))
        fut = pf.submit(steps[0])
        fut.wait_all()
        made = pf._inputs.allocations
        puts = []
        real_put = StepInputs.put
        monkeypatch.setattr(StepInputs, "put", lambda self, *a: puts.append(len(a)) or real_put(self, *a))
        guard = SyncGuard(monkeypatch)
        for step in steps[1:]:
            guard.active = True
            fut = pf.submit(step)
            guard.active = False
            fut.wait_all()
        assert guard.calls == [], f"submit() would wait for the device: {guard.calls}"
        assert len(puts) == 10, "each step's inputs go up in exactly one staged copy"
        assert pf._inputs.allocations == made, "staging buffers are reused, not made per step"


def test_new_requests_and_growth_stay_on_the_staging_ring(client, monkeypatch):
    """Fresh slots (reset with index_fill_) and a bigger step than the buffer holds: still no readback."""
    with EngramPrefetcher(client, device="cpu", max_tokens=256, resident=False) as pf:
        pf.submit(Step.decode(["a"], [1])).wait_all()
        guard = SyncGuard(monkeypatch)
        guard.active = True
        fut = pf.submit(Step.decode([f"n{i}" for i in range(100)], np.arange(100) % SPEC.compressed_vocab))
        guard.active = False
        fut.wait_all()
        assert guard.calls == []


def test_staging_ring_reuses_and_grows_on_cpu():
    st = StepInputs(torch.device("cpu"), capacity=8)
    a, b = st.put(np.arange(3), np.arange(4).reshape(2, 2))
    assert a.tolist() == [0, 1, 2] and b.tolist() == [[0, 1], [2, 3]] and st.owns(a) and st.owns(b)
    for _ in range(10):
        st.put(np.arange(5))
    assert st.allocations == 2  # the ring, made once
    (big,) = st.put(np.arange(20))
    assert big.tolist() == list(range(20)) and st.allocations == 3  # grown once, then reused
