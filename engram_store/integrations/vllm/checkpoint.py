"""vLLM's checkpoint loading with the engram-store plugin: Engram tensors are never read, and nothing
writes into the arena.

* ``weight_utils.should_skip_weight`` skips the Engram tensors before they are read (by the rule the
  engine adapter picks for the vLLM release, ``patches.engram_name_rule``); the default safetensors
  iterator is forced to its lazy strategy, and loaders that read whole files (multi-thread,
  fastsafetensors, instanttensor) are refused, as they would read 189 GiB.
* ``DefaultModelLoader.track_weights_loading`` counts the arena views as loaded.
* Paths that write into parameters (``--load-format dummy``, weight reset, in-place reload) are refused
  for a model holding arena views: the mapping is read-only and a write would fault.

Each ``make_*`` here makes the replacement of one vLLM function from its original, with what it needs
passed in (the plugin, the name rule).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from ...errors import EngineUnsupported
from ..install import Plugin, reads_whole_files, writes_tables
from ..tables import EngramStoreTables


def is_arena_tensor(plugin: Plugin, t: Any) -> bool:
    """Whether ``t`` aliases the daemon's arena mapped in this process (nothing mapped yet: nothing can)."""
    if getattr(t, "device", None) is None or t.device.type != "cpu":
        return False
    tables = EngramStoreTables.shared_if_open(plugin.address)
    return tables is not None and tables.owns(t.data_ptr())


def arena_parameters(plugin: Plugin, model: Any) -> list[str]:
    """Names of ``model``'s parameters that are views of the daemon's arena."""
    return [name for name, p in model.named_parameters() if is_arena_tensor(plugin, p)]


def make_should_skip_weight(rule: re.Pattern, original: Callable) -> Callable:
    def should_skip_weight(weight_name, local_expert_ids):
        return rule.search(weight_name) is not None or original(weight_name, local_expert_ids)

    return should_skip_weight


def make_lazy_safetensors(original: Callable) -> Callable:
    def safetensors_weights_iterator(hf_weights_files, use_tqdm_on_load, safetensors_load_strategy=None,
                                     *args, **kwargs):
        if safetensors_load_strategy not in (None, "lazy"):
            raise EngineUnsupported(f"--safetensors-load-strategy {safetensors_load_strategy} reads whole checkpoint "
                                    "files, Engram tables included (189 GiB), which engram-store serves instead; "
                                    "use the default (lazy) strategy")
        # "lazy" also turns off the automatic prefetch of checkpoints on NFS/Lustre, which reads whole files.
        return original(hf_weights_files, use_tqdm_on_load, "lazy", *args, **kwargs)

    return safetensors_weights_iterator


def make_refuse_whole_file_loader(name: str) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def refuse(*args, **kwargs):
            raise reads_whole_files(name)

        return refuse

    return make


def make_track_weights_loading(plugin: Plugin, original: Callable) -> Callable:
    def track_weights_loading(self, model, loaded_weights, *args, **kwargs):
        if loaded_weights is not None:
            loaded_weights = set(loaded_weights) | set(arena_parameters(plugin, model))
        return original(self, model, loaded_weights, *args, **kwargs)

    return track_weights_loading


def make_refuse_dummy(plugin: Plugin, original: Callable) -> Callable:
    def initialize_single_dummy_weight(param, *args, **kwargs):
        if is_arena_tensor(plugin, param):
            raise writes_tables("--load-format dummy")
        return original(param, *args, **kwargs)

    return initialize_single_dummy_weight


def make_refuse_model_write(what: str, model_at: int) -> Callable[[Plugin, Callable], Callable]:
    """A replacement refusing ``what`` for a model holding arena views (the model is argument
    ``model_at`` of the original: ``zero_weights(model, ...)``, ``reload_weights(vllm_config, model, ...)``)."""
    def make(plugin: Plugin, original: Callable) -> Callable:
        def refuse_model_write(*args, **kwargs):
            model = kwargs["model"] if "model" in kwargs else args[model_at]
            if arena_parameters(plugin, model):
                raise writes_tables(what)
            return original(*args, **kwargs)

        refuse_model_write.__name__ = getattr(original, "__name__", "refuse_model_write")
        return refuse_model_write

    return make
