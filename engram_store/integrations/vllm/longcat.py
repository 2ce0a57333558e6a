"""vLLM's LongCat-Flash n-gram embedding tables (LongCat-Flash-Lite) from the engram-store daemon.

vLLM 0.33 keeps the ``K * (N - 1)`` n-gram tables concatenated in one ``VocabParallelEmbedding``,
``NgramEmbedding.oe_embedder`` (``vllm/model_executor/models/longcat_flash_ngram.py``), sharded over
tensor parallelism by contiguous row ranges (the total padded to 64 rows). ``LongcatNgramModelState.
prepare_inputs`` computes each step's ids and calls ``NgramEmbedding.embed_batched(input_ids, oe_ids)``
before the forward, outside any CUDA graph: the rows are needed before decoder layer 0, so there is
**no layer of compute ahead** to hide a fetch behind. The plugin (:func:`targets`):

* checks the model config against the daemon's tables when the tables are built
  (:class:`~engram_store.integrations.models.longcat.NgramLayout`: family, dtype, vocab, table sizes,
  rows, row width) and builds ``oe_embedder``'s own weight on the meta device (nothing allocated);
* **resident** table: ``oe_embedder.weight`` is this TP rank's rows ``[org_vocab_start, org_vocab_end)``
  read in place from the arena (``tables.views``: zero copy, read-only; a UVA view on a GPU), so vLLM's
  own masked lookup and all-reduce run unchanged;
* **cached** table: ``oe_embedder.weight`` is a fetch job's staging; ``embed_batched`` first fetches the
  step's rows this rank owns into it, synchronously (ids outside the rank's range as ``-1``: zero rows,
  which the all-reduce expects), then runs vLLM's own ``embed_batched`` with positional ids
  (``org_vocab_start + i`` reads staging row ``i``). A rank that shares its batch with no other raises a
  failed fetch (``CorruptRows`` naming layer and pages) right there, before the rows are used; ranks
  that do share it leave it to the model runners' agreed checks before the step's tokens (:mod:`.runners`),
  as a rank leaving alone would strand its peers in the all-reduce;
* a cached table's rows of a prompt's later chunks are hinted to the daemon when the prompt is scheduled
  (:mod:`.prompt_hints`: the raw prompt hashed by the spec, each gram cut at the prompt's start and at an
  EOS looking back, an EOS position at its table's offset, as ``LongcatNgramModelState``'s token table and
  vLLM 0.33's id op have them), so chunks after the first find them in the daemon's DRAM;
* ``NgramEmbedding.load_weight`` copies nothing into the daemon's rows, and ``FlashNgramModel.load_weights``
  counts them loaded (the checkpoint's ``embedders`` tensors are skipped before they are read:
  :func:`with_table_names`).
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from ...errors import EngineUnsupported
from ..install import Plugin
from ..models.longcat import LAYER, LONGCAT, TABLE_TENSOR, NgramLayout
from ..rank_rows import RankRows, built_on_meta
from ..tables import EngramStoreTables
from . import prompt_hints, ranks, runners
from .cached import staging_job

log = logging.getLogger(__name__)

NGRAM = "vllm.model_executor.models.longcat_flash_ngram"
WEIGHT = "ngram_embeddings.oe_embedder.weight"  # the table's name as FlashNgramModel.load_weights reports it
SOURCE = ("vLLM's LongCat config (vocab_size, ngram_vocab_size_ratio, emb_neighbor_num, emb_split_num, "
          "hidden_size, dtype)")



def targets(plugin: Plugin, attr: Callable[[Any, str], Any]) -> dict:
    """LongCat's patches for ``patches._targets`` (key -> (owner, name, make)); none where vLLM's LongCat
    n-gram code does not import (that model cannot be built there either). Raises ``EngineUnsupported``
    naming a name the patches need that this vLLM lacks."""
    try:
        module = importlib.import_module(NGRAM)
    except Exception as exc:  # noqa: BLE001 - any import failure: this vLLM cannot build LongCat at all
        log.info("engram-store: vLLM's LongCat n-gram model does not import here (%s: %s); its tables are not "
                 "patched", type(exc).__name__, exc)
        return {}
    ngram, model = attr(module, "NgramEmbedding"), attr(module, "FlashNgramModel")
    attr(module, "VocabParallelEmbedding")
    attr(attr(module, "LongcatNgramModelState"), "prepare_inputs")  # the caller of embed_batched
    for method, names in (("__init__", ("m", "k", "n", "_dtype", "config")),  # what describe reads
                          ("_init_ngram_embeddings", ("VocabParallelEmbedding", "oe_embedder", "num_embedders"))):
        code = getattr(getattr(ngram, method), "__code__", None)
        missing = [name for name in names if code is not None and name not in code.co_names]
        if missing:
            raise EngineUnsupported(f"vLLM's NgramEmbedding.{method} no longer uses {missing[0]}: engram-store's "
                                    "LongCat patches were written against vLLM 0.33's")
    return {"longcat_init": (ngram, "_init_ngram_embeddings", partial(_init_tables, plugin, module)),
            "longcat_load_weight": (ngram, "load_weight", _load_weight),
            "longcat_embed_batched": (ngram, "embed_batched", partial(_embed_batched, plugin)),
            "longcat_load_weights": (model, "load_weights", _load_weights)}


def with_table_names(rule: re.Pattern) -> re.Pattern:
    """``rule`` (the checkpoint's table tensor names, skipped before they are read) widened to LongCat's
    n-gram tables."""
    return re.compile(f"(?:{rule.pattern})|(?:{TABLE_TENSOR.pattern})")


def describe(ngram: Any) -> NgramLayout:
    """The :class:`NgramLayout` an ``NgramEmbedding`` is about to build (its fields as ``__init__`` set them)."""
    tables = int(ngram.k) * (int(ngram.n) - 1)
    return NgramLayout(vocab=int(ngram.config.vocab_size), sizes=tuple(int(ngram.m + 2 * e + 1) for e in range(tables)),
                       dim=int(ngram.config.hidden_size) // tables,
                       payload_dtype=str(ngram._dtype).removeprefix("torch."))


# --- the table, built ----------------------------------------------------------------------------
@dataclass
class Served(RankRows):
    """What one ``NgramEmbedding`` serves: this rank's rows, for a cached table its fetch job, and whether
    a failed fetch is raised at once."""

    alone: bool = False  # no other rank shares this rank's batches: a failed fetch is raised at once


def _init_tables(plugin: Plugin, module: Any, original):
    def init_ngram_embeddings(self):
        import torch

        if torch.get_default_device().type == "meta":
            return original(self)  # shapes only (e.g. a dry run): nothing to map
        tables = plugin.tables()
        LONGCAT.check_layout(tables, describe(self), LONGCAT.scale_block, SOURCE)
        with built_on_meta(module):
            original(self)
        _serve(self, tables)

    return init_ngram_embeddings


def _skip_rows(param, loaded_weight, *args) -> None:
    """The weight loader of the daemon's rows: nothing is copied."""


def _serve(ngram: Any, tables: EngramStoreTables) -> Served:
    """Make ``ngram.oe_embedder.weight`` the daemon's rows of this rank (arena views or a fetch job's staging)."""
    import torch

    embedder = ngram.oe_embedder
    index = embedder.shard_indices
    served = Served("LongCat n-gram table", LAYER, tables, int(index.org_vocab_start_index),
                    int(index.org_vocab_end_index), alone=not ranks.batch_groups()[0])
    if tables.is_resident(LAYER):
        block, _ = tables.views(LAYER, served.start, served.end)
    else:
        served.job = staging_job(tables, LAYER, _max_tokens() * ngram.num_embedders, served.end - served.start,
                                 "LongCat n-gram table")
        served.ids, block, _ = tables.job_tensors(served.job)
        block = block[: served.job.max_rows]
        # the prompt's later chunks, hinted to the daemon: every table's column (TP shards rows, not tables;
        # the ranks' hints of one request are the same and the daemon reads them once)
        prompt_hints.register(LAYER, slice(0, ngram.num_embedders))
    weight = block.view(torch.uint8).view(embedder.params_dtype)
    if weight.shape[1] != embedder.embedding_dim:
        raise EngineUnsupported(f"LongCat n-gram table: vLLM wants rows of {embedder.embedding_dim} "
                                f"{embedder.params_dtype}; the daemon's rows are {block.shape[1]} bytes")
    if torch.cuda.is_available():
        if not (registration := tables.register_cuda(LAYER)):
            raise EngineUnsupported(f"LongCat n-gram table: {registration.message}")
        from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

        weight = get_accelerator_view_from_cpu_tensor(weight)  # read over UVA by vLLM's own lookup
    param = torch.nn.Parameter(weight, requires_grad=False)
    param.weight_loader = _skip_rows
    embedder.weight = param
    ngram.__dict__["_engram_store"] = served
    if served.job is None:
        log.info("engram-store: LongCat n-gram table rows [%d, %d) mapped from the daemon's arena (zero copy)",
                 served.start, served.end)
    else:
        log.warning("engram-store: LongCat's n-gram table is cached: vLLM needs its rows before decoder layer 0 "
                    "(LongcatNgramModelState.prepare_inputs), so there is no layer of compute ahead to hide the "
                    "fetch; each step waits for its rows [%d, %d) of this rank (up to %d a step). Give the table "
                    "DRAM on the daemon (placement resident) to take that off every step", served.start, served.end,
                    served.job.max_rows)
        if not served.alone:
            log.info("engram-store: this rank shares its batches with others: a failed LongCat fetch is raised at "
                     "the step's checks on every rank, before its tokens (a rank raising alone in prepare_inputs "
                     "would strand its peers in the all-reduce)")
    return served


def _max_tokens() -> int:
    """Tokens one step may hand ``embed_batched``: vLLM's ``max_num_batched_tokens``."""
    from vllm import config

    tokens = getattr(getattr(config.get_current_vllm_config(), "scheduler_config", None), "max_num_batched_tokens",
                     None)
    if not tokens:
        raise EngineUnsupported("engram-store sizes a cached LongCat n-gram table's staging by vLLM's "
                                "scheduler_config.max_num_batched_tokens, which this vLLM config does not set")
    return int(tokens)


# --- loading and lookups -------------------------------------------------------------------------
def _load_weight(original):
    def load_weight(self, weight_name, loaded_weight):
        if "_engram_store" in self.__dict__ and "ngram_embeddings.embedders." in weight_name:
            return WEIGHT  # the daemon's rows: never written (they are skipped before they are read)
        return original(self, weight_name, loaded_weight)

    return load_weight


def _load_weights(original):
    def load_weights(self, weights):
        loaded = original(self, weights)
        ngram = getattr(self, "ngram_embeddings", None)
        if ngram is not None and "_engram_store" in ngram.__dict__:
            loaded.add(WEIGHT)  # the daemon's rows stand for the checkpoint's
        return loaded

    return load_weights


def _embed_batched(plugin: Plugin, original):
    def embed_batched(self, input_ids, oe_ids):
        served: Served | None = self.__dict__.get("_engram_store")
        if served is None or served.job is None or not oe_ids.numel():
            return original(self, input_ids, oe_ids)
        positions = served.fetch(oe_ids, "max_num_batched_tokens x tables", now=True)  # before layer 0
        if served.alone:
            runners.check(plugin.tables)  # a failed fetch raises here, before its rows are used
        return original(self, input_ids, positions)

    return embed_batched
