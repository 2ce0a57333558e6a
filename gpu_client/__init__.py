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

from engram_store.client.lazy_names import lazy_names

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
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
