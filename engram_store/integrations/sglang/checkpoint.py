"""SGLang's checkpoint loading with the engram-store plugin: Engram tensors are never read.

SGLang's default loader iterates safetensors shards (single-threaded or, by
default, on a pool of threads, a sliding window of shards) and calls
``get_tensor`` for every name. These replacements iterate the same way but skip
the Engram tables' tensors by name before ``get_tensor``, so a start reads
none of their 189 GiB; what they yield for every other tensor is the same.
Loading paths that read whole files (``weight_loader_disable_mmap``, checkpoint
prefetch, fastsafetensors, instanttensor) are refused, and so are the weight fills
that would write into the read-only arena (``--load-format dummy`` and the
capture-safe fill of the overlapped start-up).
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from ...errors import EngineUnsupported
from ..install import reads_whole_files, writes_tables
from ..models import ModelAdapter
from ..models.longcat import LONGCAT
from ..models.qwen4exp import QWEN4EXP
from . import qwen4exp
from .host_table import is_arena_table
from .longcat import is_served

log = logging.getLogger(__name__)


def _is_table(model: ModelAdapter, name: str) -> bool:
    """Whether checkpoint tensor ``name`` holds rows of a table the daemon serves (V4.1's Engram, Qwen4Exp's
    PLE or LongCat's n-gram tables): never read."""
    return model.is_table_tensor(name) or LONGCAT.is_table_tensor(name) or QWEN4EXP.is_table_tensor(name)


def _refuse_whole_files(disable_mmap: bool, prefetch: bool) -> None:
    if disable_mmap:
        raise EngineUnsupported("--weight-loader-disable-mmap reads whole checkpoint files, Engram tables included "
                                "(189 GiB), which engram-store serves instead; drop the flag")
    if prefetch:
        raise EngineUnsupported("--weight-loader-prefetch-checkpoints reads whole checkpoint files, Engram tables "
                                "included (189 GiB), which engram-store serves instead; drop the flag")


def _drop_cache(path: str) -> None:
    from sglang.srt.model_loader import weight_utils

    weight_utils._drop_file_cache_after_load(path)


def _read_shard(model: ModelAdapter, path: str) -> tuple[dict[str, Any], int]:
    """Every tensor of one shard but the model's tables, and how many were skipped."""
    import safetensors

    tensors, skipped = {}, 0
    with safetensors.safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            if _is_table(model, name):
                skipped += 1
            else:
                tensors[name] = f.get_tensor(name)
    return tensors, skipped


def _log_skipped(skipped: int) -> None:
    if skipped:
        log.info("engram-store: skipped %d Engram table tensors of the checkpoint (not read: the daemon serves them)",
                 skipped)


def safetensors_weights_iterator(model: ModelAdapter, hf_weights_files: list[str], disable_mmap: bool = False,
                                 prefetch: bool = False, prefetch_num_threads: int = 4,
                                 drop_cache_after_load: bool = False) -> Iterator[tuple[str, Any]]:
    """REPLACE of SGLang's single-threaded iterator (``model``: whose tables are skipped, bound when the
    hooks are made): one shard at a time, tensor by tensor."""
    import safetensors

    _refuse_whole_files(disable_mmap, prefetch)
    skipped = 0
    for path in hf_weights_files:
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if _is_table(model, name):
                    skipped += 1
                    continue
                yield name, f.get_tensor(name)
        if drop_cache_after_load:
            _drop_cache(path)
    _log_skipped(skipped)


def buffered_multi_thread_safetensors_weights_iterator(
        model: ModelAdapter, hf_weights_files: list[str], max_workers: int, disable_mmap: bool = False, prefetch: bool = False,
        prefetch_num_threads: int = 4, drop_cache_after_load: bool = False) -> Iterator[tuple[str, Any]]:
    """REPLACE of SGLang's default multi-threaded iterator: ``max_workers`` shards read at once,
    one more read ahead, each yielded whole in name order (the same bounded window)."""
    _refuse_whole_files(disable_mmap, prefetch)
    skipped = 0
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        files = iter(hf_weights_files)
        window: collections.deque = collections.deque()
        for path in files:
            window.append((path, pool.submit(_read_shard, model, path)))
            if len(window) > max_workers:
                break
        while window:
            path, future = window.popleft()
            tensors, n = future.result()
            skipped += n
            following = next(files, None)
            if following is not None:
                window.append((following, pool.submit(_read_shard, model, following)))
            for name in sorted(tensors):
                yield name, tensors[name]
            del tensors
            if drop_cache_after_load:
                _drop_cache(path)
    _log_skipped(skipped)


def refuse_whole_file_loader(what: str) -> Callable[..., Any]:
    """A REPLACE hook refusing a loading path that reads whole checkpoint files."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise reads_whole_files(what)

    refuse.__qualname__ = f"engram_store_refuse[{what}]"
    return refuse


def refuse_write(what: str) -> Callable[..., Any]:
    """An AROUND hook refusing a weight fill over a model whose Engram tables are the arena."""
    def around(original: Callable[..., Any], model: Any, *args: Any, **kwargs: Any) -> Any:
        if any(is_arena_table(m) or is_served(m) or qwen4exp.is_served(m) for m in model.modules()):
            raise writes_tables(what)
        return original(model, *args, **kwargs)

    around.__qualname__ = f"engram_store_refuse_write[{what}]"
    return around
