"""vLLM's Qwen4Exp (Qwen3.8-Flash-Next) PLE n-gram table from the engram-store daemon.

vLLM 0.33 keeps each PLE layer's table in a storage object of ``Qwen4ExpNGramEmbedding``
(``vllm/models/qwen4_exp``): ``Qwen4ExpPLEPinnedHostEmbedding`` (``engram_config.cpu_offload``, the
default: pinned host memory read over UVA, a layer ahead, through ``start_prefetch`` /
``finalize_prefetch``) or ``Qwen4ExpPLEDeviceEmbedding`` (looked up inline in ``forward``; vLLM's CPU
platform). The plugin replaces both classes with subclasses whose table is the daemon's
(:func:`targets`), and checks the model config against the daemon's tables when the embedding is built
(:class:`~engram_store.integrations.models.qwen4exp.PLELayout`: PLE layers, rows, heads, row width and
format, ETP size):

* **resident** layer: ``weight`` (and NVFP4's block scales) are this ETP rank's contiguous rows
  ``[r * P / E, (r + 1) * P / E)`` read in place from the arena (``tables.views``: zero copy, read-only);
  vLLM's own lookup reads them: its UVA kernel on a GPU, its masked embedding on the CPU;
* **cached** layer: ``weight`` is a fetch job's staging; each step the ids this rank owns are fetched
  into it (the others as ``-1``: zero rows, which vLLM's ETP all-reduce expects) and vLLM's lookup reads
  the staging with positional ids. On a GPU the ids go to the host on the prefetch side stream and the job
  runs as a host function there (so under CUDA graphs too); on the CPU the job runs in ``start_prefetch``
  (or inline in ``forward``).

A cached layer's rows of a prompt's later chunks are hinted to the daemon when the prompt is scheduled
(:mod:`.prompt_hints`: the raw prompt hashed by the spec, positions before it and look-back past an EOS as
EOS, as ``Qwen4ExpModelState``'s ``ngram_context`` and vLLM's id kernel have them).

On ROCm vLLM builds ``amd/ple_layer.py``'s copy of ``Qwen4ExpNGramEmbedding`` over the same storage classes
(imported by name, so replaced too) and looks rows up inline through the pinned storage's ``sync_lookup``
(no prefetch seam): the plugin checks that copy's config as well (:func:`_amd_targets`) and serves it the
same way, a cached layer's fetch then running on the stream just before vLLM's lookup.

The results are reduced over ETP by vLLM's own ``_reduce_etp_embeddings``. The table's global scale
(FP8 ``weight_scale``, NVFP4 ``weight_scale_2``) is set from ``tables.table_scale(layer)``; a checkpoint
scale loaded over it must equal it. A failed fetch (a page failing its checksum) leaves zero rows and is
raised at the step's host-visible points by the model runners' checks (:mod:`.runners`, as for V4.1's
cached layers), never inside the forward, where a rank leaving early would strand its ETP peers.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import logging
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from ...errors import EngineUnsupported, ModelMismatch
from ..install import Plugin
from ..models.qwen4exp import QWEN4EXP, TABLE_TENSOR, PLELayout
from ..rank_rows import RankRows
from ..tables import EngramStoreTables
from . import prompt_hints
from .cached import staging_job

log = logging.getLogger(__name__)

NGRAM = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
COMMON = "vllm.models.qwen4_exp.common.ngram_embedding"
AMD = "vllm.models.qwen4_exp.amd.ple_layer"  # ROCm's copy of Qwen4ExpNGramEmbedding (vllm.models.qwen4_exp picks it)
PINNED, DEVICE = "Qwen4ExpPLEPinnedHostEmbedding", "Qwen4ExpPLEDeviceEmbedding"


@dataclass(frozen=True)
class Building:
    """What the storage object being built needs from its ``Qwen4ExpNGramEmbedding``."""

    layer: int
    max_tokens: int  # vLLM's max_total_tokens: the most tokens one step looks up
    heads: int  # row ids per token


_building: contextvars.ContextVar[Building | None] = contextvars.ContextVar("engram_store_ple", default=None)


def targets(plugin: Plugin, attr: Callable[[Any, str], Any]) -> dict:
    """Qwen4Exp's patches for ``patches._targets`` (key -> (owner, name, make)); none where vLLM's Qwen4Exp
    code does not import (that model cannot be built there either). Raises ``EngineUnsupported`` naming a
    name the patches need that this vLLM lacks."""
    try:
        ngram, common = importlib.import_module(NGRAM), importlib.import_module(COMMON)
    except Exception as exc:  # noqa: BLE001 - any import failure: this vLLM cannot build Qwen4Exp at all
        log.info("engram-store: vLLM's Qwen4Exp model does not import here (%s: %s); its PLE table is not patched",
                 type(exc).__name__, exc)
        return {}
    module = attr(ngram, "Qwen4ExpNGramEmbedding")
    for name in ("_make_vocab_layout", "compute_ngram_ids", "start_prefetch", "forward"):
        attr(module, name)
    for name in ("Qwen4ExpPLEEmbedding", "Qwen4ExpPLEEmbeddingMethod", "Qwen4ExpPLEFp8EmbeddingMethod",
                 "get_etp_group", "get_tp_group"):  # NVFP4's method is 0.33's alone (0.32: BF16 and FP8)
        attr(common, name)
    for name in ("_lookup", "_reduce_etp_embeddings", "start_prefetch", "_finalize_prefetch", "finalize_prefetch",
                 "sync_lookup"):
        attr(attr(common, PINNED), name)
    return {"qwen4exp_ngram_init": (module, "__init__", partial(_ngram_init, plugin)),
            "qwen4exp_pinned": (common, PINNED, partial(storage_class, plugin, common)),
            "qwen4exp_device": (common, DEVICE, partial(storage_class, plugin, common))} | _amd_targets(plugin, attr)


def _amd_targets(plugin: Plugin, attr: Callable[[Any, str], Any]) -> dict:
    """On ROCm (``current_platform.is_rocm()``, vLLM's own choice of ``amd/model.py``), the AMD copy of
    ``Qwen4ExpNGramEmbedding`` (``amd/ple_layer.py``) gets the same config check. Its storage objects are the
    common classes replaced above (it imports them by name); its ``forward`` has no prefetch seam: the custom
    op ``qwen4_exp_amd_ple_ngram_embedding_pinned`` calls the pinned storage's ``sync_lookup`` inline, which
    the replacement serves (arena views, or the fetch job on the stream before vLLM's UVA lookup)."""
    from vllm.platforms import current_platform

    if not current_platform.is_rocm():
        return {}
    try:
        amd = importlib.import_module(AMD)
    except Exception as exc:  # noqa: BLE001 - vLLM's ROCm Qwen4Exp code does not import: nor can the model build
        log.info("engram-store: vLLM's AMD Qwen4Exp PLE layer does not import here (%s: %s); it is not patched",
                 type(exc).__name__, exc)
        return {}
    module = attr(amd, "Qwen4ExpNGramEmbedding")
    for name in ("_make_vocab_layout", "forward"):
        attr(module, name)
    for name in (PINNED, DEVICE):  # bound by name at import: the patches rebind them to the replacements
        attr(amd, name)
    lookup = attr(amd, "qwen4_exp_amd_ple_ngram_embedding_pinned")
    if "sync_lookup" not in (lookup.__code__.co_names if hasattr(lookup, "__code__") else ()):
        raise EngineUnsupported(f"vLLM's {AMD}.qwen4_exp_amd_ple_ngram_embedding_pinned no longer reads the pinned "
                                "PLE storage's sync_lookup: engram-store's Qwen4Exp patches were written against "
                                "vLLM 0.33's")
    return {"qwen4exp_amd_ngram_init": (module, "__init__", partial(_ngram_init, plugin))}


def with_table_names(rule: re.Pattern) -> re.Pattern:
    """``rule`` (the checkpoint's Engram tensor names, skipped before they are read) widened to Qwen4Exp's
    PLE table tensors."""
    return re.compile(f"(?:{rule.pattern})|(?:{TABLE_TENSOR.pattern})")


# --- the model config, checked when an embedding is built ----------------------------------------
def _ngram_init(plugin: Plugin, original):
    signature = inspect.signature(original)  # NVIDIA's and AMD's differ (AMD: prefix positional, a layer name)

    def init(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments
        config, dense = given["config"], int(given["ple_dense_layer_id"])
        layout = describe(type(self), config, given["embedding_dim"], given.get("quant_config"),
                          given.get("prefix", ""), given.get("params_dtype"))
        QWEN4EXP.check_layout(plugin.tables(), layout, layout.scale_block,
                              source="vLLM's Qwen4Exp config (ple_layer_ids and the PLE table's quant method)")
        heads = (int(config.ngram_size) - 1) * int(config.heads_per_ngram)
        token = _building.set(Building(layout.layer_ids[dense], int(given["max_total_tokens"]), heads))
        try:
            original(self, *args, **kwargs)
        finally:
            _building.reset(token)

    return init


def describe(cls: type, config: Any, embedding_dim: int, quant_config: Any, prefix: str,
             params_dtype: Any = None) -> PLELayout:
    """The :class:`PLELayout` vLLM builds from ``config``, with its own helpers (the prime layout,
    the storage method the table's quant config picks) and the ETP group its storage classes read."""
    import torch
    from vllm.utils.math_utils import round_up

    common = importlib.import_module(COMMON)
    heads = (int(config.ngram_size) - 1) * int(config.heads_per_ngram)
    dense = sorted({int(i) for i in config.ple_layer_ids})
    head_sizes, rows = [], []
    for d in range(len(dense)):
        sizes, _, total = cls._make_vocab_layout(ngram_vocab_size_base=int(config.ngram_vocab_size_base),
                                                 ngram_heads=heads, ple_dense_layer_id=d)
        head_sizes.append(tuple(int(s) for s in sizes))
        rows.append(int(round_up(total, int(config.make_ngram_vocab_size_divisible_by))))
    method = common.Qwen4ExpPLEEmbeddingMethod.from_quant_config(quant_config, f"{prefix}.ngram_embedding",
                                                                 getattr(config, "ple_embedding_dtype", None))
    nvfp4 = getattr(common, "Qwen4ExpPLENvFp4EmbeddingMethod", None)  # vLLM 0.33 and later
    if nvfp4 is not None and isinstance(method, nvfp4):
        payload, block, scale = "float4_e2m1fn", 16, True
    elif isinstance(method, common.Qwen4ExpPLEFp8EmbeddingMethod):
        payload, block, scale = "float8_e4m3fn", 0, True
    else:  # unquantized: the model's dtype
        payload, block, scale = str(params_dtype or torch.get_default_dtype()).removeprefix("torch."), 0, False
    return PLELayout(layer_ids=tuple(i - 1 for i in dense), rows=tuple(rows), head_sizes=tuple(head_sizes),
                     dim=int(embedding_dim) // heads, payload_dtype=payload, scale_block=block, table_scale=scale,
                     etp_size=int(common.get_etp_group().world_size))


# --- the storage classes ------------------------------------------------------------------------
LIMIT = "max_num_batched_tokens x heads"  # what sizes a cached layer's staging


def storage_class(plugin: Plugin, common: Any, original: type) -> type:
    """The subclass of vLLM's storage class ``original`` (pinned-host or device) whose table is the daemon's."""
    base, pinned = common.Qwen4ExpPLEEmbedding, original.__name__ == PINNED
    reduce_etp = getattr(common, PINNED)._reduce_etp_embeddings  # vLLM's own ETP reduce (FP8 as int8 bytes)

    class EngramStorePLEEmbedding(original):
        def __init__(self, *args, **kwargs):
            if pinned and _gpu():
                original.__init__(self, *args, **kwargs)  # vLLM's: UVA views of the arena / staging, side stream
            else:
                if not pinned and _gpu():
                    raise EngineUnsupported("engram-store serves the PLE table from host memory: keep vLLM's "
                                            "engram_config.cpu_offload = true (the default) on a GPU")
                base.__init__(self, *args, **kwargs)
            self.__dict__["_cpu_rows"] = None
            self._engram_store_scale()

        # -- where the rows are
        def allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype):
            import torch

            if torch.get_default_device().type == "meta":
                return original.allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype)
            served = self.__dict__.get("_engram_store") or _serve(self, plugin.tables())
            width = embedding_dim * torch.empty((), dtype=dtype).element_size()
            if served.job is not None:
                _, weight, scales = served.tables.job_tensors(served.job)
            else:
                weight, scales = served.tables.views(served.layer, served.start, served.end)
            block = weight if width == weight.shape[1] else scales if width == scales.shape[1] else None
            if block is None or (served.job is None and block.shape[0] != num_embeddings):
                raise EngineUnsupported(f"PLE layer {served.layer}: vLLM wants {num_embeddings} rows of {embedding_dim}"
                                        f" {dtype} on this rank; the daemon's rows are {tuple(weight.shape)} bytes")
            return block.view(torch.uint8).view(dtype)

        def weight_loader(self, param, loaded_weight, checkpoint_start=None):
            served = self.__dict__.get("_engram_store")
            if served is None:  # shapes only (meta): nothing of the daemon's
                return original.weight_loader(self, param, loaded_weight, checkpoint_start)
            if served.tables.owns(param.data_ptr()):
                return  # the daemon's rows: never loaded (the checkpoint's are skipped before they are read)
            if param.numel() == 1:  # the table's global scale: the checkpoint's must be the daemon's
                want = served.tables.table_scale(served.layer)
                got = float(loaded_weight.float().reshape(-1)[0])
                if want is not None and got != want:
                    raise ModelMismatch(f"PLE layer {served.layer}'s table scale: the checkpoint says {got!r}, the "
                                        f"engram-store daemon at {served.tables.address} serves {want!r}: its tables "
                                        "were imported from another checkpoint")
            return original.weight_loader(self, param, loaded_weight, checkpoint_start)

        def _engram_store_scale(self):
            served = self.__dict__.get("_engram_store")
            for name in ("weight_scale_2", "weight_scale"):
                param = self._parameters.get(name)
                if served is not None and param is not None and param.numel() == 1:
                    value = served.tables.table_scale(served.layer)
                    if value is None:
                        raise EngineUnsupported(f"PLE layer {served.layer}: vLLM reads one {name} for the table; the "
                                                f"engram-store daemon at {served.tables.address} gives none (an older "
                                                "daemon or table set: upgrade it and re-import the table)")
                    param.data.fill_(value)
                    return

        # -- lookups
        def _rows(self, ids, output=None):
            """This rank's rows of ``ids`` (zeros for ids it does not own), in vLLM's lookup dtype."""
            import torch

            served = self.__dict__["_engram_store"]
            positions = served.fetch(ids, LIMIT) if served.job is not None else None
            if ids.is_cuda:  # vLLM's UVA kernel over the arena or the staging
                return original._lookup(self, ids if positions is None else positions, output)
            local = served.owned(ids if positions is None else positions) - served.start
            rows = self.embedding_method.embedding(self, local.clamp_min(0))
            dead = (local < 0).unsqueeze(-1)
            rows = rows.view(torch.uint8).masked_fill(dead, 0).view(rows.dtype) if rows.element_size() == 1 \
                else rows.masked_fill(dead, 0)
            return rows if output is None else output.copy_(rows)

        def _lookup(self, input_ids, output=None):
            return self._rows(input_ids.long(), output)

        def _reduced(self, ids):
            slot_size, slot_offset = self._get_dp_gather_slot(ids.shape[0])
            rows = self._rows(self._gather_dp_ids(ids, slot_size).long())
            if self.reduce_results:
                rows = reduce_etp(self, rows)
            return self._select_embeddings(rows, ids.shape[0], slot_offset)

        def forward(self, ngram_ids):
            return self._reduced(ngram_ids)

        def sync_lookup(self, ngram_ids):
            return self._reduced(ngram_ids)

        def start_prefetch(self, ngram_ids):
            if ngram_ids.is_cuda:
                return original.start_prefetch(self, ngram_ids)
            self.__dict__["_cpu_rows"] = self._reduced(ngram_ids)  # no side stream on the CPU: looked up (fetched) now

        def finalize_prefetch(self, total_tokens):
            if "_uva_weight" in self.__dict__:  # vLLM's join of its side stream, ETP reduce and output copy
                return original.finalize_prefetch(self, total_tokens)
            rows, self.__dict__["_cpu_rows"] = self._cpu_rows, None
            if rows is None:
                raise EngineUnsupported("PLE finalize_prefetch without a start_prefetch of the step")
            if rows.shape[0] != total_tokens:
                raise EngineUnsupported(f"PLE prefetch of {rows.shape[0]} tokens finalized for {total_tokens}")
            return rows.flatten(-2)

    EngramStorePLEEmbedding.supports_prefetch = pinned
    EngramStorePLEEmbedding.__name__ = EngramStorePLEEmbedding.__qualname__ = \
        f"EngramStore{original.__name__.removeprefix('Qwen4Exp')}"
    return EngramStorePLEEmbedding


def _serve(embedding: Any, tables: EngramStoreTables) -> RankRows:
    """The :class:`~engram_store.integrations.rank_rows.RankRows` of a storage object being built (called from its first weight allocation)."""
    import torch

    building = _building.get()
    if building is None:
        raise EngineUnsupported("a Qwen4Exp PLE storage was built outside the Qwen4ExpNGramEmbedding classes the "
                                f"plugin patches ({NGRAM}; {AMD} on ROCm): engram-store cannot tell which PLE layer "
                                "it serves")
    layer, index = building.layer, embedding.shard_indices
    served = RankRows(f"PLE layer {layer}", layer, tables, int(index.org_vocab_start_index),
                      int(index.org_vocab_end_index))
    if not tables.is_resident(layer):
        common = importlib.import_module(COMMON)
        dp = max(1, embedding.tp_size // common.get_tp_group().world_size)  # ETP spanning DP gathers DP's ids
        served.job = staging_job(tables, layer, building.max_tokens * dp * building.heads, served.end - served.start,
                                 f"PLE layer {layer}")
        served.ids, _, _ = tables.job_tensors(served.job)
        # the prompt's later chunks, hinted to the daemon: all 16 columns (ETP shards rows, not heads; the
        # ranks' hints of one request are the same and the daemon reads them once)
        prompt_hints.register(layer, slice(0, building.heads))
    if torch.cuda.is_available() and not (registration := tables.register_cuda(layer)):
        raise EngineUnsupported(f"PLE layer {layer}: {registration.message}")
    embedding.__dict__["_engram_store"] = served
    log.info("engram-store: PLE layer %d rows [%d, %d) %s", layer, served.start, served.end,
             "mapped from the daemon's arena (zero copy)" if served.job is None else
             f"fetched per step by a fetch job (up to {served.job.max_rows} rows)")
    return served


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()

