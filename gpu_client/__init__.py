"""Client side of engram-store for inference workers.

Importing this package loads neither torch nor CUDA; each name below is
imported on first use:

* ``EngramClient`` — talks to the daemon (``unix://`` or ``grpc://``);
* ``LocalClient`` — the same surface over tables in process memory;
* ``EngramPrefetcher`` / ``Step`` — layer-ahead prefetch into device buffers;
* ``dequantize`` — FP8 e4m3 rows with E8M0 block scales to bf16.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EngramClient": ".client",
    "LocalClient": ".local",
    "MemoryTables": ".local",
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
