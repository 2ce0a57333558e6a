"""The step path makes no device constants per call: every ``torch.tensor(..., device=...)``
is a host-to-device copy that waits for the GPU queue, so a submit that made them would
lose the layer-ahead overlap (checked on CPU by counting the factory's calls)."""

from __future__ import annotations

import numpy as np
import torch

from engram_store import get_spec
from engram_store.models import hashing
from gpu_client import EngramPrefetcher, LocalClient, Step

SPEC = get_spec("tiny")


def _steps(n: int, seed: int):
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield Step.from_lists(["a", "b"], [list(rng.integers(0, SPEC.compressed_vocab, 5 if i == 0 else 1))] * 2)


def test_submit_makes_no_device_constants_after_the_first_step(tiny_tables, monkeypatch):
    client = LocalClient.open(tiny_tables(seed=3)[0])
    pf = EngramPrefetcher(client, device="cpu", max_tokens=64, resident=False)
    try:
        steps = list(_steps(4, seed=1))
        pf.submit(steps[0]).wait(SPEC.layers[0])  # the first step may make them, once per (layer, device)
        made = []
        real = torch.tensor

        def counting(*args, **kwargs):
            if kwargs.get("device") is not None:
                made.append(kwargs["device"])
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, "tensor", counting)
        for step in steps[1:]:
            fut = pf.submit(step)
            for layer in SPEC.layers:
                fut.wait(layer)
        assert made == [], f"{len(made)} device constants made in 3 steps"
    finally:
        pf.close()
        client.close()


def test_cached_constants_hash_like_the_reference():
    tok = torch.from_numpy(np.random.default_rng(2).integers(0, SPEC.compressed_vocab, (50, SPEC.max_ngram)))
    for _ in range(2):  # the second call uses the cached constants
        for layer in SPEC.layers:
            np.testing.assert_array_equal(hashing.hash_suffix_torch(SPEC, layer, tok).numpy(),
                                          hashing.hash_suffix_numpy(SPEC, layer, tok.numpy()))
    other = SPEC.scaled(0.5)  # another geometry never gets this one's constants
    for layer in other.layers:
        np.testing.assert_array_equal(hashing.hash_suffix_torch(other, layer, tok).numpy(),
                                      hashing.hash_suffix_numpy(other, layer, tok.numpy()))
