"""SGLang's Qwen4Exp (Qwen3.8-Flash-Next) PLE n-gram table from the engram-store daemon.

SGLang 0.5.23 keeps each PLE layer's table in ``Qwen4ExpNGramEmbedding.ngram_embedding``
(``sglang/srt/models/qwen4_exp.py``), one ``VocabParallelEmbedding`` of FP8 or BF16 rows sharded over
the TP group (the attention-TP group with ``SGLANG_USE_ATTN_TP_NGRAM``) by contiguous row ranges, plus a
BF16 ``weight_scale`` ``[1]`` by which the looked-up rows are multiplied. Two storage paths:

* ``--ple-offload-embedding`` (SGLang's default for BF16 models on CUDA, the model's usual dtype):
  ``Qwen4ExpPinnedHostEmbedding``, the table in host memory (``allocate_ple_host_table``, backend
  ``pinned``) read by SGLang's Triton gather (``gather``: FP8/BF16 rows from a host pointer, rows this
  rank does not own as zeros, then the TP all-reduce), issued a layer ahead on the PLE layer's own stream
  (``Qwen4ExpPLELayer.start_prefetch``);
* without it, the ``VocabParallelEmbedding`` itself (masked lookup, all-reduce): the path of SGLang's
  CPU platform. On a GPU it keeps the table in GPU memory, loaded from the checkpoint: refused.

With the plugin (:func:`targets`, registered by :mod:`.hooks`), ``Qwen4ExpNGramEmbedding.__init__``
(AROUND) checks the model config against the daemon's tables first
(:class:`~engram_store.integrations.models.qwen4exp.PLELayout`: PLE layers, rows, head sizes, row width,
FP8/BF16, TP sharding; then the hash: multipliers and EOS), refuses ``--ple-offload-backend file`` and an
NVFP4 table (SGLang 0.5.23 has no NVFP4 PLE table), and makes the table the daemon's:

* **resident** layer: ``ngram_embedding.weight`` is this rank's rows ``[org_vocab_start,
  org_vocab_end)`` read in place from the arena (``tables.views``: zero copy, read-only; registered for
  the GPU, whose UVA makes the host address the kernel's), so SGLang's own gather (or masked lookup)
  reads them; ``allocate_ple_host_table`` (AROUND) hands SGLang a meta tensor meanwhile, so no pinned
  table is allocated;
* **cached** layer: ``weight`` is a fetch job's staging. Each step the ids this rank owns are fetched
  into it (the others as ``-1``: zero rows, which the all-reduce expects) and SGLang's own lookup reads
  the staging with positional ids (``org_vocab_start + i`` is staging row ``i``). On the offload path
  this happens in ``Qwen4ExpPinnedHostEmbedding.gather`` (AROUND), on the stream SGLang gathers on: the
  PLE prefetch stream a layer ahead. On a GPU the ids go to the job's registered ids on that stream and
  the job runs as a host function after them (so CUDA graphs capture it); on the CPU it runs at once. On
  the CPU's inline path it happens in ``Qwen4ExpNGramEmbedding._prepare_embedding_lookup`` (AROUND),
  synchronously, before SGLang's masked lookup. A planned prefill hints the daemon the rows of its later
  chunks (:mod:`.prompt_hints`: the raw prompt hashed by the spec, all of the layer's columns).

The table scale comes from the daemon (``tables.table_scale``) into ``weight_scale`` (refused where BF16
cannot hold it exactly); ``Qwen4ExpForConditionalGeneration._load_qwen4_exp_ple_buffer`` (AROUND) refuses
a checkpoint scale other than the daemon's, and checkpoint hash buffers (``layer_multipliers``,
``ngram_heads_*``) other than the daemon's spec. The checkpoint's table tensors are skipped before they
are read (:mod:`.checkpoint`). A failed fetch (a page failing its checksum, with no good copy) leaves
zero rows and is raised at ``Scheduler.process_batch_result`` before the step's tokens are processed
(:mod:`.failures`, its board), never inside the forward, where a rank leaving early would strand its TP
peers in the all-reduce.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import math
import types
from functools import partial
from typing import Any, Callable

from ...errors import EngineUnsupported, ModelMismatch
from ..install import Plugin
from ..models.qwen4exp import QWEN4EXP, PLELayout
from ..rank_rows import RankRows
from ..tables import EngramStoreTables
from . import prompt_hints
from .modules import engram

log = logging.getLogger(__name__)

QWEN = "sglang.srt.models.qwen4_exp"
PLE_TABLE = "sglang.srt.models.qwen4_exp_ple_table"
NGRAM, PINNED = f"{QWEN}.Qwen4ExpNGramEmbedding", f"{QWEN}.Qwen4ExpPinnedHostEmbedding"
DEFAULT_STEP_TOKENS = 4096  # a cached layer's staging, in tokens, where SGLang's schedule config is not published
SOURCE = "SGLang's Qwen4Exp config (ple_layer_ids, ngram_*, ple_embedding_dtype and the PLE table's quant config)"
SOURCE_USES = {  # method -> words of its source these hooks rely on
    "Qwen4ExpNGramEmbedding.__init__": ("config.ple_offload_embedding", "Qwen4ExpPinnedHostEmbedding(",
                                        "_ple_table_is_fp8", '"weight_scale"'),
    "Qwen4ExpNGramEmbedding._embed_ngram_ids": ("self._prepare_embedding_lookup(", "self.ngram_embedding(lookup_ids)"),
    "Qwen4ExpPinnedHostEmbedding.__init__": ("allocate_ple_host_table(", "shard_indices"),
    "Qwen4ExpPinnedHostEmbedding.gather": ("self.weight.data_ptr()", "org_vocab_start_index"),
    "Qwen4ExpPLELayer.start_prefetch": ("_prepare_embedding_lookup(", ".gather(lookup_ids"),
    "Qwen4ExpForConditionalGeneration._load_qwen4_exp_ple_buffer": ("buffer.copy_(",),
}
READS = ("_ple_table_is_fp8", "_use_attn_tp_ngram", "Qwen4ExpNGramEmbedding._find_nth_prime_after",
         "Qwen4ExpNGramEmbedding._build_head_vocab_and_offsets", "Qwen4ExpPinnedHostEmbedding")  # names read
_building: contextvars.ContextVar[int | None] = contextvars.ContextVar("engram_store_sglang_ple", default=None)
_cached: list[RankRows] = []  # this process's cached PLE layers (their steps can fail)


def targets() -> dict[str, tuple[str, Callable[[Plugin], Callable], tuple[str, ...] | None]]:
    """Qwen4Exp's hooks, in :func:`.hooks.targets`' shape (target -> (HookType name, make(plugin), the
    parameter names of the original)); none where SGLang's Qwen4Exp model does not import. Raises
    ``EngineUnsupported`` when a method's source lacks a word the hooks rely on."""
    try:
        qwen = _qwen()
    except Exception as exc:  # noqa: BLE001 - any import failure: this SGLang cannot build Qwen4Exp at all
        log.info("engram-store: SGLang's Qwen4Exp model does not import here (%s: %s); its PLE table is not hooked",
                 type(exc).__name__, exc)
        return {}
    for name in READS:
        owner, _, attr = name.rpartition(".")
        if getattr(getattr(qwen, owner) if owner else qwen, attr, None) is None:
            raise EngineUnsupported(f"engram-store's Qwen4Exp hooks read SGLang's {QWEN}.{name}, which this SGLang "
                                    "does not have")
    for name, words in SOURCE_USES.items():
        source = _source(qwen, name)  # None: a missing method (refused by the hook checks) or no source shipped
        for word in () if source is None else (w for w in words if w not in source):
            raise EngineUnsupported(f"SGLang's {name} no longer uses {word!r}: engram-store's Qwen4Exp hooks were "
                                    "written against SGLang 0.5.23's")
    with_plugin = lambda hook: lambda plugin: partial(hook, plugin)  # noqa: E731
    stateless = lambda hook: lambda plugin: hook  # noqa: E731
    return {
        f"{NGRAM}.__init__": ("AROUND", with_plugin(ngram_init),
                              ("self", "config", "embedding_dim", "ple_layer_index", "quant_config", "prefix")),
        f"{NGRAM}._prepare_embedding_lookup": ("AROUND", stateless(prepare_lookup),
                                               ("self", "ngram_ids", "forward_batch", "physical_tokens")),
        f"{PINNED}.gather": ("AROUND", stateless(gather), ("self", "input_ids", "out")),
        f"{PLE_TABLE}.allocate_ple_host_table": ("AROUND", stateless(allocate_host_table),
                                                 ("shape", "dtype", "backend", "table_dir", "tag")),
        f"{QWEN}.Qwen4ExpForConditionalGeneration._load_qwen4_exp_ple_buffer": (
            "AROUND", with_plugin(load_buffer), ("self", "name", "loaded_weight", "buffers", "loaded_buffers")),
    }


def _source(module: Any, name: str) -> str | None:
    cls, _, method = name.partition(".")
    try:
        return inspect.getsource(getattr(getattr(module, cls), method))
    except (AttributeError, OSError, TypeError):
        return None


def _qwen() -> Any:
    import sglang.srt.models.qwen4_exp as module

    return module


def has_cached() -> bool:
    """Whether this process serves a cached PLE layer (its steps can fail: :mod:`.failures`)."""
    return bool(_cached)


def is_served(module: Any) -> bool:
    """Whether ``module`` is a PLE table storage whose rows are the daemon's (never to be written)."""
    return "_engram_store_ple" in getattr(module, "__dict__", {})


def served(module: Any) -> RankRows | None:
    return getattr(module, "__dict__", {}).get("_engram_store_ple")


# --- the model config, checked; the table, served ------------------------------------------------
def describe(cls: type, config: Any, embedding_dim: int, quant_config: Any, prefix: str) -> PLELayout:
    """The :class:`PLELayout` SGLang builds from ``config``, with its own helpers (the prime layout of
    each dense PLE layer, the FP8 rule of the table's quant config) and the TP group it shards over."""
    from sglang.srt.runtime_context import get_parallel

    qwen = _qwen()
    heads = (int(config.ngram_size) - 1) * int(config.heads_per_ngram)
    dense = sorted({int(i) for i in config.ple_layer_ids})
    pad = int(config.make_ngram_vocab_size_divisible_by)
    head_sizes, rows = [], []
    for d in range(len(dense)):
        probe = types.SimpleNamespace(ngram_heads=heads, ple_layer_index=d, ngram_vocab_size_base=int(
            config.ngram_vocab_size_base), _find_nth_prime_after=cls._find_nth_prime_after)
        sizes, _, total = cls._build_head_vocab_and_offsets(probe)
        head_sizes.append(tuple(int(s) for s in sizes))
        rows.append(-(-int(total) // pad) * pad)
    table = f"{prefix}.ngram_embedding" if prefix else "ngram_embedding"
    fp8 = qwen._ple_table_is_fp8(config, quant_config, table)
    p = get_parallel()
    return PLELayout(layer_ids=tuple(i - 1 for i in dense), rows=tuple(rows), head_sizes=tuple(head_sizes),
                     dim=int(embedding_dim) // heads, payload_dtype="float8_e4m3fn" if fp8 else "bfloat16",
                     scale_block=0, table_scale=fp8,
                     etp_size=int(p.attn_tp_size if qwen._use_attn_tp_ngram() else p.tp_size))


def ngram_init(plugin: Plugin, original: Callable, self: Any, config: Any, embedding_dim: int,
               ple_layer_index: int = 0, quant_config: Any = None, prefix: str = "") -> None:
    """AROUND ``Qwen4ExpNGramEmbedding.__init__``: the config checked, then SGLang's build with the table
    the daemon's (nothing of it allocated: see :func:`allocate_host_table`)."""
    import torch

    plugin.check_applied()
    if torch.get_default_device().type == "meta":  # shapes only: nothing of the daemon's
        return original(self, config, embedding_dim, ple_layer_index, quant_config, prefix)
    offload = bool(getattr(config, "ple_offload_embedding", False))
    backend = getattr(config, "ple_offload_backend", "pinned")
    if offload and backend != "pinned":
        raise EngineUnsupported(f"--ple-offload-backend {backend} maps SGLang's own file of the PLE table; "
                                "engram-store serves the table from its daemon: use --ple-offload-backend pinned "
                                "(the default)")
    if not offload and torch.cuda.is_available():
        raise EngineUnsupported("--no-ple-offload-embedding keeps the PLE table in GPU memory, loaded from the "
                                "checkpoint; engram-store serves it from host memory: use --ple-offload-embedding "
                                "(SGLang's default for BF16 models on CUDA)")
    tables = plugin.tables()
    if tables.spec.row_format.payload_dtype == "float4_e2m1fn":
        raise EngineUnsupported(f"the engram-store daemon at {tables.address} serves an NVFP4 PLE table (spec "
                                f"{tables.spec.name!r}); SGLang 0.5.23 reads FP8 and BF16 PLE tables only: import the "
                                "checkpoint's FP8 or BF16 table into the daemon")
    layout = describe(type(self), config, embedding_dim, quant_config, prefix)
    QWEN4EXP.check_layout(tables, layout, 0, source=SOURCE)
    layer = layout.layer_ids[int(ple_layer_index)]
    token = _building.set(layer)
    try:
        original(self, config, embedding_dim, ple_layer_index, quant_config, prefix)
    finally:
        _building.reset(token)
    check_hash(tables, layer, self, SOURCE)
    _serve(self, layer, tables)


def check_hash(tables: EngramStoreTables, layer: int, ngram: Any, source: str) -> None:
    """Raise ``ModelMismatch`` where ``ngram``'s hash (its multipliers, head sizes and offsets, EOS) differs
    from the daemon's spec for ``layer``: the same rows would be read for other n-grams."""
    import numpy as np

    spec = tables.spec
    for field, got, want in (("PLE multipliers", ngram.layer_multipliers, spec.multipliers_array(layer)),
                             ("PLE head sizes", ngram.ngram_heads_vocab_sizes, spec.sizes(layer).reshape(-1)),
                             ("PLE head offsets", ngram.ngram_heads_offsets, spec.offsets(layer).reshape(-1)),
                             ("EOS token", np.asarray([ngram.eos_token_id]), np.asarray([spec.pad_id]))):
        got = np.asarray(got.cpu() if hasattr(got, "cpu") else got, dtype=np.int64).reshape(-1)
        if not np.array_equal(got, np.asarray(want, dtype=np.int64)):
            raise ModelMismatch(f"{field} of PLE layer {layer}: {source} says {got.tolist()}, the engram-store daemon "
                                f"at {tables.address} hashes with {np.asarray(want).tolist()} (spec "
                                f"{spec.name!r}); import this checkpoint's table into the daemon")


def allocate_host_table(original: Callable, shape: Any, dtype: Any, backend: str = "pinned", table_dir: Any = None,
                        tag: Any = None) -> Any:
    """AROUND ``allocate_ple_host_table``: while a served PLE table is built, a meta tensor (the daemon's
    rows take its place right after: :func:`_serve`); otherwise SGLang's."""
    if _building.get() is None:
        return original(shape, dtype, backend, table_dir, tag)
    import torch

    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _serve(ngram: Any, layer: int, tables: EngramStoreTables) -> None:
    """``ngram.ngram_embedding``'s weight made this rank's rows of the daemon's table (resident) or a fetch
    job's staging (cached); its ``weight_scale`` the daemon's."""
    import torch

    emb = ngram.ngram_embedding
    index = emb.shard_indices
    start, end = int(index.org_vocab_start_index), int(index.org_vocab_end_index)
    served = RankRows(f"PLE layer {layer}", layer, tables, start, end)
    if tables.is_resident(layer):
        block, _ = tables.views(layer, start, end)
    else:
        rows = _staging_rows(ngram, layer, end - start)
        served.job = tables.fetch_job(layer, rows)
        served.ids, block, _ = tables.job_tensors(served.job)
        # the prompt's later chunks, hinted to the daemon: all the layer's columns (TP shards rows, not heads;
        # the ranks' hints of one request are the same and the daemon reads them once)
        prompt_hints.register(layer, slice(0, int(ngram.ngram_heads)))
    if torch.cuda.is_available():  # SGLang's gather reads weight.data_ptr() itself: the host address, over UVA
        if not (registration := tables.register_cuda(layer)):
            raise EngineUnsupported(f"PLE layer {layer}: {registration.message}; SGLang's gather cannot read it")
        if int(engram()._registered_device_ptr(block.data_ptr())) != block.data_ptr():
            raise EngineUnsupported(f"PLE layer {layer}: the GPU maps the daemon's rows at another address than the "
                                    "host's (HIP without it); SGLang's PLE gather reads the host address itself")
    dtype = emb.weight.dtype
    if block.shape[1] != emb.embedding_dim * torch.empty((), dtype=dtype).element_size():
        raise ModelMismatch(f"PLE layer {layer}: SGLang builds rows of {emb.embedding_dim} {dtype}, the engram-store "
                            f"daemon at {tables.address} serves rows of {block.shape[1]} bytes")
    old = emb.weight
    weight = torch.nn.Parameter(block.view(torch.uint8).view(dtype), requires_grad=False)
    for name, value in vars(old).items():  # SGLang's weight_loader and shard attributes
        setattr(weight, name, value)
    emb.weight = weight
    emb.__dict__["_engram_store_ple"] = served
    _set_scale(emb, served)
    if served.job is not None:
        _cached.append(served)
    log.info("engram-store: PLE layer %d rows [%d, %d) %s", layer, start, end,
             "read in place from the daemon's arena (zero copy)" if served.job is None else
             f"fetched per step by a fetch job (up to {served.job.max_rows} rows a step)")


def _staging_rows(ngram: Any, layer: int, rank_rows: int) -> int:
    """Rows a cached layer's staging holds: SGLang's largest step x heads, at most this rank's rows (the
    positional ids stay within them). A step is at most a prefill chunk (``max_prefill_tokens``, or
    ``chunked_prefill_size`` grown by a quarter under PP dynamic chunking) beside every running request's
    decode tokens (speculative drafts included), over the DP group when the ids are gathered across it.
    Chunked prefill off is refused: a whole prompt would be one step, larger than any staging sized ahead."""
    from sglang.srt.runtime_context import get_parallel, get_schedule, get_spec

    try:
        s = get_schedule()
    except ValueError:  # not published (SGLang's model built outside a server): the default
        tokens = DEFAULT_STEP_TOKENS
    else:
        chunked = int(s.chunked_prefill_size or 0)
        if chunked <= 0:
            raise EngineUnsupported(f"PLE layer {layer} is cached and SGLang's chunked prefill is off "
                                    "(--chunked-prefill-size -1): a whole prompt would be one fetch, larger than "
                                    "the staging sized ahead; turn chunked prefill on, or give the table DRAM on "
                                    "the daemon (resident)")
        try:
            drafts = max(1, int(getattr(get_spec(), "speculative_num_draft_tokens", None) or 1))
        except ValueError:  # no speculative config published
            drafts = 1
        tokens = max(int(s.max_prefill_tokens or 0), math.ceil(chunked * 1.25)) + \
            int(s.max_running_requests or 0) * drafts
    if ngram.gather_dp_tokens:
        tokens *= int(get_parallel().attn_dp_size)
    return min(max(tokens, 1) * int(ngram.ngram_heads), rank_rows)


def _set_scale(emb: Any, served: RankRows) -> None:
    """The daemon's table scale into SGLang's BF16 ``weight_scale`` (an FP8 table; a BF16 one has none)."""
    value = served.tables.table_scale(served.layer)
    if value is None:
        return
    emb.weight_scale.fill_(value)
    if float(emb.weight_scale.float()[0]) != value:
        raise EngineUnsupported(f"PLE layer {served.layer}: SGLang holds the table scale in {emb.weight_scale.dtype}, "
                                f"which cannot hold the engram-store daemon's {value!r} exactly")


# --- each step's rows ----------------------------------------------------------------------------
def _fetch(served: RankRows, ids: Any) -> Any:
    """A cached layer's rows of ``ids`` into its staging; the positional ids SGLang's lookup reads."""
    return served.fetch(ids.long(), "SGLang's max_prefill_tokens, chunked_prefill_size and max_running_requests "
                        "x heads, at most the rank's rows")


def gather(original: Callable, self: Any, input_ids: Any, out: Any = None) -> Any:
    """AROUND ``Qwen4ExpPinnedHostEmbedding.gather``: a cached layer's rows fetched first (on the stream
    SGLang gathers on), then SGLang's gather over the staging; a resident layer's unchanged."""
    s = served(self)
    if s is None or s.job is None or not input_ids.numel():
        return original(self, input_ids, out)
    return original(self, _fetch(s, input_ids), out)


def prepare_lookup(original: Callable, self: Any, ngram_ids: Any, forward_batch: Any, physical_tokens: int) -> Any:
    """AROUND ``Qwen4ExpNGramEmbedding._prepare_embedding_lookup``: on the inline path (no offload: the
    CPU), a cached layer's rows fetched now and the positional ids handed to SGLang's masked lookup."""
    lookup_ids, semantic_tokens = original(self, ngram_ids, forward_batch, physical_tokens)
    emb = self.ngram_embedding
    s = served(emb)
    if s is None or s.job is None or isinstance(emb, _qwen().Qwen4ExpPinnedHostEmbedding) or not lookup_ids.numel():
        return lookup_ids, semantic_tokens
    return _fetch(s, lookup_ids), semantic_tokens


# --- the checkpoint's PLE buffers ----------------------------------------------------------------
def load_buffer(plugin: Plugin, original: Callable, self: Any, name: str, loaded_weight: Any, buffers: dict,
                loaded_buffers: set) -> bool:
    """AROUND ``_load_qwen4_exp_ple_buffer``: a checkpoint's table scale must be the daemon's, and its hash
    buffers (which override SGLang's recipe) the daemon's spec."""
    path, _, leaf = name.rpartition(".")
    owner = _submodule(self, path)
    s = served(owner)
    want = s.tables.table_scale(s.layer) if s is not None and leaf == "weight_scale" else None
    got = None if want is None else float(loaded_weight.float().reshape(-1)[0])
    if got != want:
        raise ModelMismatch(f"PLE layer {s.layer}'s table scale: the checkpoint says {got!r}, the engram-store daemon "
                            f"at {s.tables.address} serves {want!r}: its tables were imported from another checkpoint")
    handled = original(self, name, loaded_weight, buffers, loaded_buffers)
    if handled and owner is not None and served(getattr(owner, "ngram_embedding", None)) is not None:
        s = served(owner.ngram_embedding)
        check_hash(s.tables, s.layer, owner, f"the checkpoint's {name}")
    return handled


def _submodule(model: Any, path: str) -> Any:
    try:
        return model.get_submodule(path)
    except (AttributeError, TypeError):
        return None

