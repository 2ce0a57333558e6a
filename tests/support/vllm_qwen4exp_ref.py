"""vLLM 0.33's own Qwen4Exp PLE n-gram ids as an independent reference, run in a fresh process.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python tests/support/vllm_qwen4exp_ref.py IN.npz OUT.npz

``IN.npz`` holds the config values ``bases`` (``ngram_vocab_size_base`` values), ``vocab``,
``seed``, ``eos``, ``ngram_size``, ``heads`` (per order), ``dense_ids`` and cases ``c{i}_tokens``,
``c{i}_qsl`` (``query_start_loc``), ``c{i}_ctx`` (``ngram_context`` ``[B, ngram_size - 1]``).
``OUT.npz`` gets per base index ``b`` and dense id ``d`` ``b{b}_d{d}_multipliers``, ``_sizes``,
``_offsets``, ``_padded`` from ``Qwen4ExpNGramEmbedding._make_layer_multipliers`` /
``_make_vocab_layout`` and vLLM's ``round_up`` (divisor 128), and per case ``c{i}_triton`` from
``ple_ngram_ids`` (the Triton kernel under the interpreter) and ``c{i}_torch`` from
``compute_ngram_ids``'s CPU fallback, both for the first base and dense id 0. Used by tests/test_qwen4exp.py.

vLLM is installed without its dependencies here, so importing its Qwen4Exp module meets
``compressed_tensors`` (a quantization package it only names): a stand-in module answers any
name in it; no code of it runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ABSENT = ("compressed_tensors",)  # packages vLLM imports for other quantization methods


class _AnyType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyType(name, (), {})


class _AnyModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyType(name, (), {"__init__": lambda self, *a, **k: None})


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ABSENT:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _AnyModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def main(inp: str, out: str) -> None:
    sys.meta_path.append(_StandIns())
    from vllm.models.qwen4_exp.common.ops.ple import ple_ngram_ids
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding as Q
    from vllm.utils.math_utils import round_up

    a = np.load(inp)
    ngram_size, heads, eos = int(a["ngram_size"]), int(a["heads"]), int(a["eos"])
    n_heads = (ngram_size - 1) * heads
    result = {}
    for b, base in enumerate(int(x) for x in a["bases"]):
        for d in (int(x) for x in a["dense_ids"]):
            sizes, offsets, total = Q._make_vocab_layout(ngram_vocab_size_base=base, ngram_heads=n_heads,
                                                         ple_dense_layer_id=d)
            mult = Q._make_layer_multipliers(ngram_size=ngram_size, unigram_vocab_size=int(a["vocab"]),
                                             seed=int(a["seed"]), ple_dense_layer_id=d)
            result |= {f"b{b}_d{d}_multipliers": np.asarray(mult, dtype=np.int64),
                       f"b{b}_d{d}_sizes": np.asarray(sizes), f"b{b}_d{d}_offsets": np.asarray(offsets),
                       f"b{b}_d{d}_padded": round_up(total, 128)}
    mult, sizes, offsets = (torch.from_numpy(result[f"b0_d0_{k}"]).to(torch.int64)
                            for k in ("multipliers", "sizes", "offsets"))
    module = types.SimpleNamespace(ngram_size=ngram_size, heads_per_ngram=heads, eos_token_id=eos,
                                   layer_multipliers=mult, ngram_heads_vocab_sizes=sizes, ngram_heads_offsets=offsets,
                                   _shift_precompute=Q._shift_precompute, _shift_apply=Q._shift_apply)
    i = 0
    while f"c{i}_tokens" in a:
        ids = torch.from_numpy(a[f"c{i}_tokens"]).to(torch.int32)
        qsl = torch.from_numpy(a[f"c{i}_qsl"]).to(torch.int32)
        ctx = torch.from_numpy(a[f"c{i}_ctx"]).to(torch.int32)
        result[f"c{i}_triton"] = ple_ngram_ids(ids, qsl, ctx, mult, sizes, offsets, eos, heads).numpy()
        result[f"c{i}_torch"] = Q.compute_ngram_ids(module, ids, qsl, ctx).numpy()
        i += 1
    np.savez(out, **result)
    print(f"OK {i} cases, {sum(result[f'c{j}_triton'].shape[0] for j in range(i))} positions", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
