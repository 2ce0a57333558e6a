"""Run ``tests/support/vllm_qwen4exp_ref.py`` (vLLM 0.33's own Qwen4Exp PLE ids, in a fresh process under
Triton's interpreter) on the arrays a test gives it; skips the test when vLLM is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import REPO


def vllm_reference(tmp: Path, spec, bases: list[int], dense_ids: list[int], eos: int, **arrays) -> dict:
    """vLLM's layout of PLE tables with prime ``bases`` for ``dense_ids``, and its ids of every case in
    ``arrays`` (see the script's docstring for the names), as a dict of arrays."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    inp, out = tmp / "in.npz", tmp / "out.npz"
    np.savez(inp, bases=np.asarray(bases), vocab=spec.compressed_vocab, seed=spec.seed, eos=eos,
             ngram_size=spec.max_ngram, heads=spec.heads, dense_ids=np.asarray(dense_ids), **arrays)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "VLLM_"))}
    env |= {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "vllm_qwen4exp_ref.py"), str(inp),
                             str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return dict(np.load(out))
