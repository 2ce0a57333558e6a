"""The torch side of the client, for inference workers: prefetch into device buffers.

Importing this package loads neither torch nor CUDA; each name below is
imported on first use:

* ``EngramClient`` — talks to the daemon (``unix://`` or ``grpc://``), and
  ``LocalClient`` — the same surface over tables in process memory: both from
  :mod:`engram_store.client` (no torch), re-exported here;
* ``EngramPrefetcher`` / ``Step`` — layer-ahead prefetch into device buffers;
* ``dequantize`` — FP8 e4m3 rows with E8M0 block scales to bf16.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EngramClient": "engram_store.client.client",
    "LocalClient": "engram_store.client.local",
    "MemoryTables": "engram_store.client.local",
    "EngramPrefetcher": ".prefetch",
    "PrefetchFuture": ".future",
    "Step": ".step",
    "dequantize": ".dequant",
    "ArenaGather": ".resident",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpu_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
