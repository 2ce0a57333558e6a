"""vLLM 0.33's own Qwen4Exp PLE checkpoint loader as an independent reference, run in a fresh process.

    CUDA_VISIBLE_DEVICES= python tests/support/vllm_qwen4exp_loader.py JOBS.json

Each job of ``JOBS.json`` (a list) names a checkpoint directory ``ckpt``, the tensor-name prefix
of one PLE layer ``prefix`` (``model.language_model.layers.1.ple.ple_embedding.``), ``format``
(``fp8``, ``bf16`` or ``nvfp4``), the padded table's ``rows``, ``dim``, ``parts``
(``split_ngram_parts``), ``etp`` (ranks the table is split over) and ``out`` (an ``.npz``).

For every ETP rank it builds a ``PLEVocabParallelEmbedding`` holding that rank's row range (its
``__init__`` needs a distributed init, so only ``nn.Module``'s runs, and ``shard_indices`` is
given), then hands the layer's checkpoint tensors, by their module-relative names, to
``Qwen4ExpNGramEmbedding.load_weights`` (vLLM's shard-index and shape checks, its
``weight_loader`` copying each shard's overlap with the rank's rows). The table scales
(loaded by ``AutoWeightsLoader``, which needs the real model) are left out. ``out`` gets
``rows`` (uint8 ``[rows, row_bytes]``: the ranks' tables concatenated, payload then block
scales) and the buffers as loaded.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from support.vllm_qwen4exp_ref import _StandIns  # noqa: E402

SCALES = ("ngram_embedding.weight_scale", "ngram_embedding.weight_scale_2")  # loaded by AutoWeightsLoader


def _rank_table(cls, method, start: int, end: int, rows: int, params):
    emb = cls.__new__(cls)
    torch.nn.Module.__init__(emb)
    emb.shard_indices = types.SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=end)
    emb.org_vocab_size = rows
    emb.embedding_method = method
    for name, width, dtype in params:
        param = torch.nn.Parameter(torch.zeros(end - start, width, dtype=dtype), requires_grad=False)
        param.weight_loader = emb.weight_loader
        emb.register_parameter(name, param)
    return emb


def run(job: dict) -> None:
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLENvFp4EmbeddingMethod
    from vllm.models.qwen4_exp.common.ple import PLEVocabParallelEmbedding
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    rows, dim, etp, prefix = job["rows"], job["dim"], job["etp"], job["prefix"]
    params = {"fp8": [("weight", dim, torch.float8_e4m3fn)], "bf16": [("weight", dim, torch.bfloat16)],
              "nvfp4": [("weight", dim // 2, torch.uint8), ("weight_scale", dim // 16, torch.float8_e4m3fn)]}
    method = object.__new__(Qwen4ExpPLENvFp4EmbeddingMethod) if job["format"] == "nvfp4" else None
    tensors = {}
    for path in sorted(Path(job["ckpt"]).glob("*.safetensors")):
        tensors |= {k[len(prefix):]: v for k, v in load_file(str(path)).items() if k.startswith(prefix)}
    weights = [(k, v) for k, v in tensors.items() if k not in SCALES]
    heads = tensors["ngram_heads_offsets"].numel()
    out_rows, buffers = [], {}
    for r in range(etp):
        emb = _rank_table(PLEVocabParallelEmbedding, method, r * rows // etp, (r + 1) * rows // etp, rows,
                          params[job["format"]])
        module = types.SimpleNamespace(
            layer_multipliers=torch.zeros(tensors["layer_multipliers"].numel(), dtype=torch.long),
            ngram_heads_offsets=torch.zeros(heads, dtype=torch.long),
            ngram_heads_vocab_sizes=torch.zeros(heads, dtype=torch.long),
            ngram_embedding=emb, split_ngram_parts=job["parts"])
        Qwen4ExpNGramEmbedding.load_weights(module, weights)
        out_rows.append(np.concatenate([getattr(emb, name).data.view(torch.uint8).numpy()
                                        for name, _, _ in params[job["format"]]], axis=1))
        buffers = {k: getattr(module, k).numpy() for k in
                   ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")}
    np.savez(job["out"], rows=np.concatenate(out_rows), **buffers)


def main(path: str) -> None:
    sys.meta_path.append(_StandIns())
    jobs = json.loads(Path(path).read_text())
    for job in jobs:
        run(job)
    print(f"OK {len(jobs)} tables", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
