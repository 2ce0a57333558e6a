"""SGLang's LongCat-Flash n-gram embedding tables (LongCat-Flash-Lite) from the engram-store daemon.

SGLang 0.5.23 builds ``NgramEmbedding`` (``sglang/srt/layers/n_gram_embedding.py``) as LongCat's
``embed_tokens`` when the config enables n-gram embeddings: its ``oe_embeder`` is one
``VocabParallelEmbedding`` of the ``K * (N - 1)`` tables concatenated, sharded over the TP group by
contiguous row ranges. ``NgramEmbedding.forward`` computes each step's row ids itself, inside the model
forward (so inside decode CUDA graphs), with its id kernel over the per-request token table, then looks
them up in ``oe_embeder`` (masked lookup, all-reduce), projects and averages. The ids are SGLang's: an
EOS current token hashed with its look-back (the spec's ``eos_current = "rehash"``). The table's rows
do not depend on that rule, so the plugin serves the daemon's rows by SGLang's own ids whatever rule
the daemon's spec names (the rule matters to ids computed from tokens: the prompt hints hash with
SGLang's, :mod:`.prompt_hints`).

The hooks (:func:`targets`, registered by :mod:`.hooks`):

* ``NgramEmbedding.__init__`` (AROUND): checks SGLang's arguments against the daemon's tables
  (:class:`~engram_store.integrations.models.longcat.NgramLayout`: family, dtype, vocab, table sizes,
  rows, row width; ``ModelMismatch`` naming both sides), refuses DP attention (the table sharded over
  the attention-TP group: not served), builds ``oe_embeder`` on the meta device (nothing allocated) and
  serves it:

  - **resident** table: ``oe_embeder.weight`` is this TP rank's rows ``[org_vocab_start,
    org_vocab_end)`` read in place from the arena (``tables.views``: zero copy, read-only; a UVA view on
    a GPU), so SGLang's own lookup and all-reduce run unchanged;
* ``NgramEmbedding.init_buffers`` (AFTER), **cached** table: SGLang sizes its id buffer here
  (``max(chunked_prefill_size, max_running_requests)`` tokens); the plugin makes a fetch job for as
  many rows, whose staging is ``oe_embeder.weight``, and wraps ``oe_embeder``'s forward: the step's ids
  this rank owns are fetched into the staging synchronously, the others as ``-1`` (zero rows, which the
  all-reduce expects), and SGLang's own lookup reads the staging with positional ids (``org_vocab_start
  + i`` is staging row ``i``). On the CPU the job runs inline. On a GPU the ids go to the job's
  registered ids on the current stream and the job runs as a host function after them
  (``cuLaunchHostFunc``: captured into decode graphs, one row count per captured batch size). A planned
  prefill hints the daemon the rows of its later chunks (:mod:`.prompt_hints`: the raw prompt hashed with
  SGLang's EOS rule, every table's column);
* ``NgramEmbedding.load_weight`` (AROUND): the checkpoint's ``embedders`` tensors are never written over
  the daemon's rows (the checkpoint iterators skip them before they are read: :mod:`.checkpoint`).

A failed fetch (a page failing its checksum, with no good copy) leaves zero rows and is raised where
the step's tokens become host-visible, at ``Scheduler.process_batch_result`` on every rank sharing the
batch (:mod:`.failures`, its board), never inside the forward, where a rank leaving early would strand
its TP peers in the all-reduce.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from functools import partial
from typing import Any, Callable

from ...errors import EngineUnsupported
from ..install import Plugin
from ..models.longcat import LAYER, LONGCAT, NgramLayout
from ..rank_rows import RankRows, built_on_meta
from ..tables import EngramStoreTables
from . import prompt_hints

log = logging.getLogger(__name__)

NGRAM = "sglang.srt.layers.n_gram_embedding"
LIMIT = "SGLang's n-gram id buffer x tables"  # what sizes a cached table's staging
SOURCE = "SGLang's LongCat config (vocab_size, ngram_embedding_m/k/n, hidden_size, dtype)"
SOURCE_USES = {  # method -> words of its source these hooks rely on
    "__init__": ("VocabParallelEmbedding", "self.oe_embeder", "is_dp_attention_enabled"),
    "init_buffers": ("self.oe_n_gram_ids",),
    "forward": ("self.oe_embeder(", "self.oe_n_gram_ids"),
    "load_weight": ("model.ngram_embeddings.embedders.", "self.oe_embeder.weight"),
}

_cached: list[RankRows] = []  # this process's cached tables (their steps can fail)


def targets() -> dict[str, tuple[str, Callable[[Plugin], Callable], tuple[str, ...] | None]]:
    """LongCat's hooks, in :func:`.hooks.targets`' shape (target -> (HookType name, make(plugin), the
    parameter names of the original)); none where SGLang's n-gram module does not import. Raises
    ``EngineUnsupported`` when a method's source lacks a word the hooks rely on."""
    try:
        module = importlib.import_module(NGRAM)
    except Exception as exc:  # noqa: BLE001 - any import failure: this SGLang cannot build LongCat's n-gram model
        log.info("engram-store: SGLang's n-gram embedding does not import here (%s: %s); LongCat's tables are not "
                 "hooked", type(exc).__name__, exc)
        return {}
    ngram = getattr(module, "NgramEmbedding", None)
    for method, words in SOURCE_USES.items():
        try:
            source = inspect.getsource(getattr(ngram, method))
        except (AttributeError, OSError, TypeError):
            continue  # a missing method is refused by the hook checks; no source shipped: the signatures stand
        missing = [word for word in words if word not in source]
        if missing:
            raise EngineUnsupported(f"SGLang's NgramEmbedding.{method} no longer uses {missing[0]!r}: engram-store's "
                                    "LongCat hooks were written against SGLang 0.5.23's")
    cls = f"{NGRAM}.NgramEmbedding"
    with_plugin = lambda hook: lambda plugin: partial(hook, plugin)  # noqa: E731
    return {
        f"{cls}.__init__": ("AROUND", with_plugin(init), ("self", "num_embeddings", "embedding_dim", "over_embedding_m",
                                                          "over_embedding_k", "over_embedding_n", "eos_token_id")),
        f"{cls}.init_buffers": ("AFTER", lambda plugin: init_buffers,
                                ("self", "max_running_requests", "chunked_prefill_size", "device")),
        f"{cls}.load_weight": ("AROUND", lambda plugin: load_weight, ("self", "param", "weight_name", "loaded_weight")),
    }


def describe(num_embeddings: int, embedding_dim: int, m: int, k: int, n: int, dtype: Any) -> NgramLayout:
    """The :class:`NgramLayout` SGLang's ``NgramEmbedding`` builds from its arguments."""
    tables = int(k) * (int(n) - 1)
    return NgramLayout(vocab=int(num_embeddings), sizes=tuple(int(m) + 2 * e + 1 for e in range(tables)),
                       dim=int(embedding_dim) // tables, payload_dtype=str(dtype).removeprefix("torch."))


def has_cached() -> bool:
    """Whether this process serves a cached LongCat table (its steps can fail: :mod:`.failures`)."""
    return bool(_cached)


def is_served(module: Any) -> bool:
    """Whether ``module`` is an ``NgramEmbedding`` whose table is the daemon's (never to be written)."""
    return "_engram_store" in getattr(module, "__dict__", {})


# --- the table, built ----------------------------------------------------------------------------
def init(plugin: Plugin, original: Callable, self: Any, num_embeddings: int, embedding_dim: int,
         over_embedding_m: int, over_embedding_k: int, over_embedding_n: int, eos_token_id: int) -> None:
    """AROUND ``NgramEmbedding.__init__``: the config checked against the daemon's tables, ``oe_embeder``
    built on meta and its rows made the daemon's."""
    import sys

    import torch

    args = (num_embeddings, embedding_dim, over_embedding_m, over_embedding_k, over_embedding_n, eos_token_id)
    if torch.get_default_device().type == "meta":
        return original(self, *args)  # shapes only: nothing to map
    plugin.check_applied()
    module = sys.modules[NGRAM]
    if module.is_dp_attention_enabled():
        raise EngineUnsupported("LongCat n-gram table with --enable-dp-attention: SGLang shards it over the "
                                "attention-TP group, which engram-store's SGLang plugin does not serve; drop "
                                "--enable-dp-attention or unset ENGRAM_STORE_ADDR")
    tables = plugin.tables()
    layout = describe(num_embeddings, embedding_dim, over_embedding_m, over_embedding_k, over_embedding_n,
                      torch.get_default_dtype())
    LONGCAT.check_layout(tables, layout, LONGCAT.scale_block, SOURCE)
    with built_on_meta(module, sum(layout.sizes), layout.dim):
        original(self, *args)
    _serve(self, tables)
    if tables.spec.eos_current != "rehash":
        log.info("engram-store: SGLang hashes an EOS current token with its look-back (eos_current 'rehash'); the "
                 "daemon's spec %r says %r (vLLM 0.33's rule). The rows are the same: SGLang's own ids are served",
                 tables.spec.name, tables.spec.eos_current)
    return None


def _serve(ngram: Any, tables: EngramStoreTables) -> RankRows:
    """A resident table's ``oe_embeder.weight`` is this rank's arena rows; a cached one's waits for
    ``init_buffers`` (its staging is sized by SGLang's id buffer)."""
    embedder = ngram.oe_embeder
    index = embedder.shard_indices
    served = RankRows("LongCat n-gram table", LAYER, tables, int(index.org_vocab_start_index),
                      int(index.org_vocab_end_index))
    ngram.__dict__["_engram_store"] = served
    if tables.is_resident(LAYER):
        block, _ = tables.views(LAYER, served.start, served.end)
        _set_weight(embedder, block, tables)
        log.info("engram-store: LongCat n-gram table rows [%d, %d) mapped from the daemon's arena (zero copy)",
                 served.start, served.end)
    return served


def _set_weight(embedder: Any, block: Any, tables: EngramStoreTables) -> None:
    """``embedder.weight`` over ``block`` (the daemon's rows, uint8 ``[rows, row_bytes]``) in SGLang's dtype."""
    import torch

    dtype = embedder.weight.dtype
    if block.shape[1] != embedder.embedding_dim * dtype.itemsize:
        raise EngineUnsupported(f"LongCat n-gram table: SGLang wants rows of {embedder.embedding_dim} {dtype}; the "
                                f"daemon's rows are {block.shape[1]} bytes")
    weight = block.view(torch.uint8).view(dtype)
    if torch.cuda.is_available():
        if not (registration := tables.register_cuda(LAYER)):
            raise EngineUnsupported(f"LongCat n-gram table: {registration.message}")
        weight = _device_view(weight)
    embedder.weight = torch.nn.Parameter(weight, requires_grad=False)


def _device_view(weight: Any) -> Any:
    """GPU hosts only (not run on CPU): a CUDA tensor over registered host memory ``weight`` (UVA; on ROCm
    the mapped address SGLang's engram module asks the runtime for), read in place by SGLang's lookup."""
    import torch
    from sglang.srt.layers.engram import _registered_device_ptr

    from gpu_client.resident import host_memory_as_cuda

    ptr = int(_registered_device_ptr(weight.data_ptr()))
    device = torch.device("cuda", torch.cuda.current_device())
    rows = host_memory_as_cuda(ptr, (weight.shape[0], weight.shape[1] * weight.dtype.itemsize), weight, device)
    return rows.view(weight.dtype)  # the view keeps the host tensor alive (host_memory_as_cuda's owner)


def init_buffers(result: Any, self: Any, max_running_requests: int, chunked_prefill_size: int, device: Any) -> None:
    """AFTER ``NgramEmbedding.init_buffers``: a cached table's fetch job, sized by SGLang's id buffer, its
    staging ``oe_embeder.weight``, and ``oe_embeder``'s forward fetching each step's rows first."""
    served: RankRows | None = self.__dict__.get("_engram_store")
    if served is None or served.job is not None or served.tables.is_resident(LAYER):
        return None
    tables = served.tables
    rows = int(self.oe_n_gram_ids.shape[0]) * int(self.n_grams)
    if rows > served.end - served.start:
        raise EngineUnsupported(f"LongCat n-gram table: a step may fetch {rows} rows ({self.oe_n_gram_ids.shape[0]} "
                                f"tokens x {self.n_grams} tables), more than the {served.end - served.start} rows of "
                                "this rank, which the staging's positional ids must stay within; lower "
                                "--chunked-prefill-size and --max-running-requests")
    served.job = tables.fetch_job(LAYER, rows)
    served.ids, block, _ = tables.job_tensors(served.job)
    embedder = self.oe_embeder
    _set_weight(embedder, block[: served.job.max_rows], tables)
    embedder.forward = partial(_fetch_then_lookup, served, embedder.forward)
    _cached.append(served)
    # the prompt's later chunks, hinted to the daemon: every table's column (TP shards rows, not tables; the
    # ranks' hints of one request are the same and the daemon reads them once)
    prompt_hints.register(LAYER, slice(0, int(self.n_grams)))
    log.warning("engram-store: LongCat's n-gram table is cached: SGLang computes its ids inside the forward, before "
                "decoder layer 0, so each step waits for its rows [%d, %d) of this rank (up to %d a step), with no "
                "compute ahead to hide the fetch. Give the table DRAM on the daemon (placement resident) to take that "
                "off every step", served.start, served.end, served.job.max_rows)
    return None


def _fetch_then_lookup(served: RankRows, lookup: Callable, input_: Any) -> Any:
    """``oe_embeder``'s forward for a cached table: the step's rows fetched, then SGLang's lookup over them."""
    if not input_.numel():
        return lookup(input_)
    return lookup(served.fetch(input_, LIMIT))


def load_weight(original: Callable, self: Any, param: Any, weight_name: str, loaded_weight: Any) -> Any:
    """AROUND ``NgramEmbedding.load_weight``: the daemon's rows are never written (read-only arena, staging)."""
    if is_served(self) and "ngram_embeddings.embedders." in weight_name:
        return None
    return original(self, param, weight_name, loaded_weight)
