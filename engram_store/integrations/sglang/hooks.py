"""The SGLang engine adapter: what the plugin hooks in SGLang, and the checks before it hooks anything.

:data:`SGLANG` is the :class:`~engram_store.integrations.install.EngineAdapter` that
:func:`engram_store.integrations.install.install` runs with DeepSeek-V4.1's model adapter.
:func:`targets` declares every hook; each is made for the installed
:class:`~engram_store.integrations.install.Plugin` (passed in) when the hooks are registered.

Every hook goes through SGLang's own ``HookRegistry`` (which also rebinds
``from x import f`` copies). Before one is registered, SGLang's version and every
hooked or read name are looked up, and the signatures of the functions replaced
are compared with the ones these hooks were written against: an SGLang without
one of them is refused as a whole (:class:`~engram_store.errors.EngineUnsupported`).
``HookRegistry.apply_hooks`` logs and skips a hook it cannot apply, so the hooks
that run at model build check that every other one is in place, and raise.

The hooks (SGLang 0.5.23):

* ``EngramLayout.from_config`` (AFTER): checks the model config's Engram layout
  against the daemon's tables (layer ids, rows, head sizes, dim, scale block).
* ``EngramEmbedding.__init__`` (BEFORE): refuses peer shards and a disabled host
  table (both keep the table in GPU memory, loaded from the checkpoint).
* ``EngramEmbedding._init_host_table`` (REPLACE): the layer's host table is the
  arena, shared layout, no memfd, no ``/proc/<pid>/fd``, nothing loaded
  (:mod:`.host_table`).
* ``EngramEmbedding._load_rows`` (AROUND): a no-op for arena tables.
* ``EngramHasher.forward`` (AFTER), ``EngramEmbedding.forward`` (AROUND): each Engram layer's
  rows gathered a layer ahead on side streams, a cached layer's fetched by its fetch jobs
  (:mod:`.prefetch`, :mod:`.chain`); ``EngramRowStager.from_model`` (AROUND): no scheduler
  staging when a layer is cached; ``Scheduler.process_batch_result`` (AROUND): a fetch's failure
  raised once the step's tokens are on the host, before SGLang appends or streams them
  (:mod:`.failures`).
* ``weight_utils.safetensors_weights_iterator`` and
  ``buffered_multi_thread_safetensors_weights_iterator`` (REPLACE): the same
  iteration, skipping the Engram tensors before they are read; fastsafetensors,
  instanttensor, checkpoint prefetch and ``weight_loader_disable_mmap`` read
  whole files and are refused; dummy and capture-safe weight fills would write
  into the read-only arena and are refused (:mod:`.checkpoint`).
* Qwen4Exp's PLE n-gram table: the hooks of :mod:`.qwen4exp` (its ``targets()``).
* LongCat-Flash's n-gram tables: the hooks of :mod:`.longcat` (its ``targets()``).
"""

from __future__ import annotations

import inspect
import logging
import pkgutil
from functools import partial
from typing import Any, Callable

from ...errors import EngineUnsupported
from ..install import Plugin, install as install_plugin, installed, installed_tables
from ..models.deepseek_v41 import DEEPSEEK_V41
from ..tables import EngramStoreTables
from . import checkpoint, failures, host_table, longcat, prefetch, prompt_hints, qwen4exp
from .modules import ENGRAM, SCHEDULER, STAGING, WEIGHT_UTILS

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("0.5.23",)  # SGLang releases whose Engram code these hooks were written against

# Names read (not hooked): the module attributes the replacements call, and for each
# method whose body we rely on, a word its source must contain.
READ_NAMES = (f"{ENGRAM}.FP8_BLOCK_SIZE", f"{ENGRAM}._sorted_host_reads", f"{ENGRAM}._registered_device_ptr",
              f"{ENGRAM}.envs", f"{ENGRAM}.EngramEmbedding._table_ptrs", f"{ENGRAM}.EngramEmbedding.forward",
              f"{ENGRAM}.EngramEmbedding._reduce_owned_rows", f"{ENGRAM}.EngramEmbedding.new_rows",
              "sglang.srt.runtime_context.get_parallel", "sglang.srt.layers.cp.utils.is_cp_active",
              "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context.is_in_breakable_cuda_graph",
              f"{WEIGHT_UTILS}._drop_file_cache_after_load", "sglang.srt.plugins.load_plugins")
SOURCE_USES = {  # method -> attributes of an EngramEmbedding our host table sets, which it must read
    f"{ENGRAM}.EngramEmbedding._table_ptrs": ("_host_table_ptrs", "host_table"),
    f"{ENGRAM}.EngramEmbedding._shared": ("host_table.layout", '"shared"'),
    f"{ENGRAM}.EngramEmbedding.shared_host_table_without_ats": ("_sort_host_reads",),
    f"{ENGRAM}.EngramEmbedding.__init__": ("SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS", "_init_host_table",
                                            "weight_loader = self._load_rows"),
    f"{ENGRAM}.EngramEmbedding._lookup": ("_reduce_owned_rows",),  # the per_rank sum the split columns rely on
    f"{ENGRAM}.EngramEmbedding._reduce_owned_rows": ("tensor_model_parallel_all_reduce",),
}
ENV_FLAGS = ("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT",
             "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS", "SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING")

Hooks = dict[str, tuple[str, Callable, tuple[str, ...] | None]]  # target -> (HookType name, hook, signature)


class SGLangHooks:
    """The :class:`~engram_store.integrations.install.EngineAdapter` of SGLang: hooks registered with
    SGLang's ``HookRegistry``, which applies them when SGLang loads its plugins."""

    name = "SGLang"
    supported_versions = SUPPORTED_VERSIONS

    def version(self) -> str:
        return sglang_version()

    def prepare(self, plugin: Plugin) -> tuple[Hooks, dict[str, Any]]:
        hooks = {target: (hook_type, make(plugin), signature)
                 for target, (hook_type, make, signature) in targets().items()}
        originals = {target: _resolve(target) for target in hooks}
        for target, (_, _, signature) in hooks.items():
            if signature is not None:
                _check_signature(target, originals[target], signature)
        for name in READ_NAMES:
            _resolve(name)
        for name, words in SOURCE_USES.items():
            _check_source(name, words)
        envs = _resolve(f"{ENGRAM}.envs")
        for flag in ENV_FLAGS:
            if getattr(envs, flag, None) is None:
                raise EngineUnsupported(f"engram-store's SGLang plugin reads SGLang's {flag}, which this SGLang "
                                        "does not declare")
        _resolve("sglang.srt.plugins.hook_registry.HookRegistry")  # what apply registers with
        return hooks, originals

    def apply(self, plugin: Plugin, prepared: tuple[Hooks, dict[str, Any]]) -> dict[str, Any]:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        hooks, originals = prepared
        for target, (hook_type, hook, _) in hooks.items():
            HookRegistry.register(target, hook, getattr(HookType, hook_type))
        return originals

    def check_applied(self, plugin: Plugin) -> None:
        """HookRegistry skips, with a log line, a hook it could not apply; a model half hooked would load
        the tables."""
        missing = [target for target, original in plugin.originals.items() if _resolve(target) is original]
        if missing:
            raise EngineUnsupported(f"SGLang's HookRegistry did not apply engram-store's hooks on {', '.join(missing)} "
                                    "(see its 'Failed to apply hooks' log line); refusing to build a model that would "
                                    "load the Engram tables from the checkpoint")


SGLANG = SGLangHooks()


def install(address: str) -> Plugin:
    """Check SGLang and register the hooks that read DeepSeek-V4.1's Engram tables from the daemon at
    ``address``."""
    return install_plugin(SGLANG, DEEPSEEK_V41, address)


def installed_address() -> str | None:
    """The daemon's address when the plugin is installed in this process (for tests)."""
    return getattr(installed(SGLANG.name), "address", None)


def tables() -> EngramStoreTables:
    """The installed plugin's tables (for callers outside the plugin: tests, tools)."""
    return installed_tables(SGLANG.name)


def sglang_version() -> str:
    try:
        from sglang.version import __version__
    except Exception as exc:
        raise EngineUnsupported(f"engram-store's SGLang plugin cannot read SGLang's version: {exc}") from exc
    return str(__version__)


# --- what is hooked --------------------------------------------------------------------
def _stateless(hook: Callable) -> Callable[[Plugin], Callable]:
    return lambda plugin: hook


def targets() -> dict[str, tuple[str, Callable[[Plugin], Callable], tuple[str, ...] | None]]:
    """target -> (HookType name, make(plugin) -> hook, parameter names of the original that the hook
    takes over, or None when it only wraps)."""
    files = ("hf_weights_files",)
    with_model = lambda hook: lambda plugin: partial(hook, plugin.model)  # noqa: E731
    with_plugin = lambda hook: lambda plugin: partial(hook, plugin)  # noqa: E731
    hooks = {
        f"{ENGRAM}.EngramLayout.from_config": ("AFTER", with_plugin(host_table.check_layout), ("cls", "config")),
        f"{ENGRAM}.EngramEmbedding.__init__": ("BEFORE", with_plugin(host_table.before_embedding_init),
                                               ("self", "num_embeddings", "dim", "layer_id", "column_bounds")),
        f"{ENGRAM}.EngramEmbedding._init_host_table": ("REPLACE", with_plugin(host_table.init_host_table),
                                                       ("self", "num_embeddings", "dim", "layer_id")),
        f"{ENGRAM}.EngramEmbedding._load_rows": ("AROUND", _stateless(host_table.load_rows),
                                                 ("self", "param", "loaded_weight")),
        f"{WEIGHT_UTILS}.safetensors_weights_iterator": (
            "REPLACE", with_model(checkpoint.safetensors_weights_iterator),
            files + ("disable_mmap", "prefetch", "prefetch_num_threads", "drop_cache_after_load")),
        f"{WEIGHT_UTILS}.buffered_multi_thread_safetensors_weights_iterator": (
            "REPLACE", with_model(checkpoint.buffered_multi_thread_safetensors_weights_iterator),
            files + ("max_workers", "disable_mmap", "prefetch", "prefetch_num_threads", "drop_cache_after_load")),
        f"{WEIGHT_UTILS}.fastsafetensors_weights_iterator": (
            "REPLACE", _stateless(checkpoint.refuse_whole_file_loader("--load-format fastsafetensors")), None),
        f"{WEIGHT_UTILS}.instanttensor_weights_iterator": (
            "REPLACE", _stateless(checkpoint.refuse_whole_file_loader("--load-format instanttensor")), None),
        f"{WEIGHT_UTILS}._prefetch_all_checkpoints": (
            "REPLACE", _stateless(checkpoint.refuse_whole_file_loader("--weight-loader-prefetch-checkpoints")), None),
        f"{WEIGHT_UTILS}.initialize_dummy_weights": (
            "AROUND", _stateless(checkpoint.refuse_write("--load-format dummy")), None),
        f"{WEIGHT_UTILS}.initialize_capture_safe_weights": (
            "AROUND", _stateless(checkpoint.refuse_write("filling the weights for overlapped start-up")), None),
        # every layer's rows a layer ahead, cached layers through fetch jobs (prefetch.py)
        f"{ENGRAM}.EngramHasher.forward": ("AFTER", _stateless(prefetch.after_hasher), None),
        f"{ENGRAM}.EngramEmbedding.forward": ("AROUND", _stateless(prefetch.forward),
                                              ("self", "indices", "forward_batch", "cp_all_tokens")),
        f"{STAGING}.EngramRowStager.from_model": ("AROUND", _stateless(prefetch.stager_from_model),
                                                  ("cls", "model", "hasher", "device")),
        f"{SCHEDULER}.Scheduler.process_batch_result": ("AROUND", with_plugin(failures.before_results),
                                                        ("self", "batch", "result")),
        # prompt hints: a planned prefill's later chunks read ahead by the daemon (prompt_hints.py)
        f"{SCHEDULER}.Scheduler.get_new_batch_prefill": (
            "AFTER", lambda plugin: partial(prompt_hints.after_prefill_plan, plugin.tables), None),
    }
    hooks |= longcat.targets()  # LongCat-Flash's n-gram tables (longcat.py)
    hooks |= qwen4exp.targets()  # Qwen4Exp's PLE n-gram table (qwen4exp.py)
    return hooks


def _resolve(target: str) -> Any:
    """The object at ``target`` as HookRegistry sees it (the function behind a classmethod)."""
    path, _, name = target.rpartition(".")
    try:
        owner = pkgutil.resolve_name(path)
    except Exception as exc:
        raise EngineUnsupported(f"engram-store's SGLang plugin needs {path}, which does not import here: "
                                f"{type(exc).__name__}: {exc}") from exc
    raw = owner.__dict__.get(name) if isinstance(owner, type) else None
    if isinstance(raw, (classmethod, staticmethod)):
        return raw.__func__
    if isinstance(raw, property):
        return raw.fget
    value = getattr(owner, name, None)
    if value is None:
        raise EngineUnsupported(f"engram-store's SGLang plugin hooks or reads {target}, which this SGLang does not have")
    return value


def _check_signature(target: str, fn: Any, expected: tuple[str, ...]) -> None:
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = ()
    if names != expected:
        raise EngineUnsupported(f"SGLang's {target} takes {names}, engram-store's hook was written for {expected}")


def _check_source(target: str, words: tuple[str, ...]) -> None:
    try:
        source = inspect.getsource(_resolve(target))
    except (OSError, TypeError):
        return  # no source shipped: the signature and name checks stand
    for word in words:
        if word not in source:
            raise EngineUnsupported(f"SGLang's {target} no longer uses {word!r}, which engram-store's hooks rely on")
