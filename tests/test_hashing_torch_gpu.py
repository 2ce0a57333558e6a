"""Row-id hashing on CUDA equals the numpy reference (CUDA only; skipped on CPU-only machines)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_store import get_spec
from engram_store.models.hashing import next_history_numpy, next_history_torch, row_ids_numpy, row_ids_torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: GPU hashing is checked by bench/device_check.py on a GPU host")


@pytest.mark.parametrize("name", ["deepseek-v4.1-flash", "engram-27b", "tiny"])
def test_cuda_row_ids_equal_numpy(name):
    spec = get_spec(name)
    rng = np.random.default_rng(0)
    for _ in range(10):
        lengths = rng.integers(0, 50, size=int(rng.integers(1, 12)))
        tokens = rng.integers(0, spec.compressed_vocab, size=int(lengths.sum()))
        tokens[rng.random(tokens.size) < 0.05] = -1
        cu = np.concatenate([[0], np.cumsum(lengths)])
        hist = rng.integers(-1, spec.compressed_vocab, size=(lengths.size, spec.history_len))
        t, c, h = (torch.from_numpy(x).cuda() for x in (tokens, cu, hist))
        for layer in spec.layers:
            got = row_ids_torch(spec, layer, t, c, h)
            assert got.is_cuda
            np.testing.assert_array_equal(got.cpu().numpy(), row_ids_numpy(spec, layer, tokens, cu, hist))
        np.testing.assert_array_equal(next_history_torch(spec, t, c, h).cpu().numpy(),
                                      next_history_numpy(spec, tokens, cu, hist))


def test_cuda_prefetch_matches_cpu(tmp_path):
    from engram_store.tools.synth import write_synthetic
    from gpu_client import EngramPrefetcher, LocalClient, Step

    spec = get_spec("tiny")
    write_synthetic(tmp_path / "t", spec, seed=3)
    step = Step.from_lists(["a", "b"], [[1, 2, 3, 4], [5, -1, 7]])
    with LocalClient.open(tmp_path / "t") as client:
        for resident in (True, False):
            with EngramPrefetcher(client, device="cuda", resident=resident, max_tokens=16) as gpu, \
                    EngramPrefetcher(client, device="cpu", resident=resident, max_tokens=16) as cpu:
                g, c = gpu.submit(step), cpu.submit(step)
                for layer in spec.layers:
                    np.testing.assert_array_equal(g.wait(layer).cpu().numpy(), c.wait(layer).numpy())
