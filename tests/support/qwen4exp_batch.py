"""One step's batch of Qwen4Exp PLE inputs as vLLM's model state hands them, shared by
``tests/test_vllm_qwen4exp.py`` and the scenario script it runs (``vllm_qwen4exp_plugin.py``): numpy only."""

from __future__ import annotations

import numpy as np


def batch(spec, seed: int, tokens: int = 80) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input_ids int32 [tokens], query_start_loc int32 [4], ngram_context int32 [3, 2])``: three requests'
    chunks, about 10% EOS tokens, the first at its start (EOS context), the others past theirs."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, spec.compressed_vocab, tokens)
    ids[rng.random(tokens) < 0.1] = spec.pad_id
    qsl = np.array([0, 30, 55, tokens], dtype=np.int32)
    ctx = np.array([[spec.pad_id, spec.pad_id], [11, 12], [spec.pad_id, 7]], dtype=np.int32)
    return ids.astype(np.int32), qsl, ctx
