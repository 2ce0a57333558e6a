"""bench/device_check.py's checks of model families other than DeepSeek-V4.1: LongCat-Flash-Lite's row ids
on the device (torch against numpy) and, on CUDA, against vLLM 0.33's compiled ``ngram_compute_n_gram_ids`` op."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from _common import check_row as row

from engram_store import get_spec
from engram_store.models.hashing import row_ids, row_ids_torch

REPO = Path(__file__).resolve().parent.parent


def check_longcat(device, cpu_only: bool) -> list[dict]:
    """LongCat-Flash-Lite's ids: the torch twin on ``device`` vs numpy over EOS-rich requests; on CUDA,
    vLLM 0.33's own model state and compiled id op (a fresh process) vs row_ids at every step."""
    sys.path.insert(0, str(REPO / "tests"))
    from support.longcat_ref import lookback, make_script, run_reference

    spec = get_spec("longcat-flash-lite")
    script = make_script(np.random.default_rng(39), spec.compressed_vocab, spec.pad_id)
    steps = []
    for rows_ in script["plan"]:
        tokens = np.concatenate([script["seqs"][r][s:s + n] for r, s, n in rows_])
        steps.append((tokens, np.concatenate([[0], np.cumsum([n for _, _, n in rows_])]),
                      lookback(script["seqs"], rows_, spec.history_len)))
    want = [row_ids(spec, 0, t, cu, lb) for t, cu, lb in steps]
    twin = sum(np.array_equal(row_ids_torch(spec, 0, torch.from_numpy(t).to(device), torch.from_numpy(cu).to(device),
                                            lookback=torch.from_numpy(lb).to(device)).cpu().numpy(), w)
               for (t, cu, lb), w in zip(steps, want))
    out = [row("longcat hash", twin == len(steps), f"{twin}/{len(steps)} steps equal", f"torch on {device} vs numpy")]
    if cpu_only:
        return out + [row("longcat-op", None, "", "no CUDA (tests/test_longcat.py runs it over a CPU stand-in)")]
    try:
        import vllm._custom_ops  # noqa: F401  (loads the compiled ops)
    except Exception as exc:  # noqa: BLE001  (any import failure is the reason for the skip)
        return out + [row("longcat-op", None, "", f"vLLM does not import: {exc}")]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ref = run_reference({"vocab": spec.compressed_vocab, "hidden": 3072, "eos": spec.pad_id,
                                 "n": spec.max_ngram, "k": spec.heads, "ratios": [78], "max_num_reqs": 8,
                                 "events": script["events"]}, Path(tmp), "cuda")
        except AssertionError as exc:  # the reference process failed: its output's last line says why
            return out + [row("longcat-op", False, "", str(exc).strip().splitlines()[-1][:200])]
    same = sum(np.array_equal(ref[f"s{k}"], w) for k, w in enumerate(want))
    ok = same == len(want) and not ref["standin"]
    return out + [row("longcat-op", ok, f"{same}/{len(want)} steps equal",
                      "vLLM's compiled op" if not ref["standin"] else "the CPU stand-in ran: the compiled op is absent")]
